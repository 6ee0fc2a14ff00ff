"""``python -m sglang.launch_server`` with the API key taken from the environment, not argv.

    EAGLE3_API_KEY=... python -m patches.sglang_serve <sglang.launch_server arguments>

Started by ``patches.launch`` (never directly), which filters the key out of this process's
output. SGLang reads its key only from ``--api-key``; the flag is added to the arguments parsed
here, in-process, so it never appears in this process's command line (``ps``). The rest is
SGLang's own ``launch_server`` main: plugins, ServerArgs, ``run_server``, and the process tree
killed on the way out. The names used are in patches/sglang_releases.py.
"""

from __future__ import annotations

import os
import sys

from patches.launch import API_KEY_ENV


def main() -> None:
    key = os.environ.pop(API_KEY_ENV)  # SGLang's subprocesses get it inside ServerArgs, not from the environment
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.common import kill_process_tree

    load_plugins()
    server_args = prepare_server_args([*sys.argv[1:], "--api-key", key])
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()

"""Start a real SGLang server that writes hidden-state dumps.

    python -m patches.launch --dump-dir DIR [--dump-rid-prefix eagle3-] [--dump-aux-layers 2 16 29]
        [--dump-max-bytes N] [--dump-max-pending-bytes N] -- <sglang.launch_server arguments>

Checks that the installed SGLang is a supported release (without importing it) and that
the server flags give correct dumps; refuses the flags that would break them, adds the
ones the hook needs, prints what it decided, then execs ``python -m
sglang.launch_server``. The dump settings reach every scheduler subprocess inside the
``--forward-hooks`` JSON (see patches/sglang_hook.py); the only environment change is
PYTHONPATH, so that those processes can import ``patches``.

The server's API key is never a flag (``ps`` shows every user the command lines): it comes in
the environment variable ``EAGLE3_API_KEY``. SGLang then runs as a child
(``patches.sglang_serve``, which sets the key on its ServerArgs in-process) whose output
passes through this process with the key replaced by ``***``: SGLang logs its ServerArgs,
key included, at start-up.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from patches.dumps import RID_PREFIX, DumpSettings, default_aux_layer_ids
from patches.sglang_hook import HookConfig, forward_hook_specs
from patches.sglang_releases import Release, release

PROJECT_ROOT = Path(__file__).resolve().parent.parent
#: the server's API key reaches the server (the launcher or the transformers engine) in this variable
API_KEY_ENV = "EAGLE3_API_KEY"
#: flags that carry a key: on a command line it is visible to every user of the host (``ps``)
KEY_FLAGS = ("--api-key", "--admin-api-key")


def flag_values(args: Sequence[str], flag: str) -> list[str]:
    """Every value ``args`` give ``flag`` (``flag VALUE`` or ``flag=VALUE``), abbreviations included:
    argparse, which parses both engines' flags, takes any unambiguous prefix (``--ho`` for ``--host``)."""
    values = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if len(name) > 2 and name.startswith("--") and flag.startswith(name):
            values.append(value if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return values


class LaunchRefused(ValueError):
    """The server flags or the model would give wrong or missing dumps; the message says which."""


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]             # sglang.launch_server arguments, ours added
    hook_config: HookConfig
    notes: list[str]            # what was added or accepted, and why


def dump_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m patches.launch", allow_abbrev=False,
                                description="SGLang with the EAGLE-3 hidden-state dump hook.",
                                usage="%(prog)s --dump-dir DIR [dump options] -- <sglang.launch_server arguments>")
    p.add_argument("--dump-dir", required=True, type=Path, help="existing folder the server writes dumps to")
    p.add_argument("--dump-rid-prefix", default=RID_PREFIX, help="only requests whose rid starts with this are dumped")
    p.add_argument("--dump-aux-layers", type=int, nargs="+", default=None,
                   help="HF hidden_states indices of the aux taps (default: EAGLE-3's [2, N//2, N-3])")
    p.add_argument("--dump-max-bytes", type=int, default=None, help="cap on the dump folder's size")
    p.add_argument("--dump-max-pending-bytes", type=int, default=DumpSettings.max_pending_bytes,
                   help="host memory the writer queue may hold; over it a piece is refused (error marker)")
    p.add_argument("--dump-instance", default=None,
                   help="this launch's nonce, written into every dump piece and shown in /server_info's "
                        "forward_hooks (default: a fresh random one)")
    p.add_argument("--dump-writer-threads", type=int, default=DumpSettings.writer_threads,
                   help="threads writing dump files (one writes ~0.5 GB/s into /dev/shm)")
    return p


def _server_flag_parser() -> argparse.ArgumentParser:
    """The SGLang flags the plan looks at (every other flag passes through untouched)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--model-path", "--model", dest="model_path")
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    p.add_argument("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int, default=1)
    p.add_argument("--attn-cp-size", "--attention-context-parallel-size", dest="attn_cp_size", type=int, default=1)
    p.add_argument("--dcp-size", dest="dcp_size", type=int, default=1)
    p.add_argument("--enable-layernorm-sp", action="store_true")
    p.add_argument("--disable-prefill-cuda-graph", action="store_true")
    p.add_argument("--sleep-on-idle", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-backend-prefill")
    p.add_argument("--cuda-graph-config")
    p.add_argument("--enable-return-aux-hidden-states", action="store_true")
    p.add_argument("--return-aux-hidden-state-layer-ids", nargs="+")
    p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-draft-model-path")
    p.add_argument("--forward-hooks")
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--enable-mixed-chunk", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--skip-server-warmup", action="store_true")
    return p


def read_model_config(model_path: str) -> tuple[str, int]:
    """(architecture, number of decoder layers) from a local model folder's config.json."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise LaunchRefused(f"--model-path {model_path}: no {path}; the dump hook needs a local model folder") from None
    text = config.get("text_config") or config
    try:
        return config["architectures"][0], int(text["num_hidden_layers"])
    except (KeyError, IndexError, TypeError) as exc:
        raise LaunchRefused(f"{path} names no architectures[0] or num_hidden_layers: {exc!r}") from exc


def plan_launch(rel: Release, dump_args: argparse.Namespace, server_argv: Sequence[str],
                model: tuple[str, int] | None = None) -> LaunchPlan:
    """Check the server flags against the dump's needs; return the argv to start SGLang with.

    ``model`` is (architecture, layer count); read from ``--model-path`` when None.
    """
    flags, _ = _server_flag_parser().parse_known_args(list(server_argv))
    notes: list[str] = []
    if not flags.model_path:
        raise LaunchRefused("no --model-path among the sglang arguments")
    dump_dir = Path(dump_args.dump_dir)
    if not dump_dir.is_dir():
        raise LaunchRefused(f"--dump-dir {dump_dir} does not exist (create it on the node first; a typo must not "
                            "make the server write somewhere else)")
    architecture, num_layers = model or read_model_config(flags.model_path)
    if architecture not in rel.architectures:
        raise LaunchRefused(f"model {flags.model_path} is a {architecture}; the dump hook on SGLang {rel.version} "
                            f"supports {', '.join(rel.architectures)}")
    try:
        layer_ids = tuple(dump_args.dump_aux_layers or default_aux_layer_ids(num_layers))
    except ValueError as exc:
        raise LaunchRefused(f"model {flags.model_path}: {exc}; pass --dump-aux-layers") from exc
    bad = [i for i in layer_ids if not 1 <= i < num_layers]
    if bad or len(set(layer_ids)) != len(layer_ids):
        raise LaunchRefused(f"--dump-aux-layers {list(layer_ids)}: SGLang captures the input of a decoder layer, "
                            f"so ids must be distinct HF hidden_states indices in [1, {num_layers})")

    for flag in KEY_FLAGS:
        if flag_values(server_argv, flag):
            raise LaunchRefused(f"{flag} on the command line is visible to every user of the node (ps); "
                                f"put the key in the environment variable {API_KEY_ENV} instead")
    for name, value in (("--pp-size", flags.pp_size), ("--attn-cp-size", flags.attn_cp_size),
                        ("--dcp-size", flags.dcp_size)):
        if value != 1:
            raise LaunchRefused(f"{name} {value}: a request's rows would be split across ranks "
                                "(pipeline stages or context-parallel shards); the hook sees one rank's part")
    if flags.enable_layernorm_sp:
        raise LaunchRefused("--enable-layernorm-sp: the logits processor's input is sequence-sharded across TP ranks")
    if flags.speculative_draft_model_path or (flags.speculative_algorithm and not flags.enable_return_aux_hidden_states):
        raise LaunchRefused("--speculative-algorithm/--speculative-draft-model-path: speculative verify and draft "
                            "forwards are not prefills; serve the target model alone")
    if flags.enable_return_aux_hidden_states or flags.return_aux_hidden_state_layer_ids:
        raise LaunchRefused("--enable-return-aux-hidden-states/--return-aux-hidden-state-layer-ids: the launcher sets "
                            "them from --dump-aux-layers, so the dump's layer ids cannot disagree with SGLang's")
    if flags.cuda_graph_backend_prefill not in (None, "disabled"):
        raise LaunchRefused(f"--cuda-graph-backend-prefill {flags.cuda_graph_backend_prefill}: the prefill CUDA graph "
                            "replay rebuilds the ForwardBatch without rids, so no request could be dumped")
    if flags.cuda_graph_config:
        prefill = (json.loads(flags.cuda_graph_config).get("prefill") or {}).get("backend")
        if prefill not in (None, "disabled"):
            raise LaunchRefused(f"--cuda-graph-config sets the prefill backend {prefill!r}: the prefill CUDA graph "
                                "replay rebuilds the ForwardBatch without rids, so no request could be dumped")

    argv = _drop_flag(list(server_argv), "--forward-hooks")
    if not flags.disable_prefill_cuda_graph:
        argv.append("--disable-prefill-cuda-graph")
        notes.append("added --disable-prefill-cuda-graph: its replay drops ForwardBatch.rids (decode graphs stay on)")
    if not flags.sleep_on_idle:
        argv.append("--sleep-on-idle")
        notes.append("added --sleep-on-idle: an idle scheduler otherwise loops in Python, and the dump writer's threads "
                     "in its process wait for the GIL (the last pieces of a run landed seconds late)")
    if rel.aux_capture == "builtin":
        argv += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                 "--return-aux-hidden-state-layer-ids", *(str(i - 1) for i in layer_ids)]
        notes.append(f"added --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "
                     f"--return-aux-hidden-state-layer-ids {' '.join(str(i - 1) for i in layer_ids)}: SGLang's own "
                     f"EAGLE-3 capture without a draft (SGLang id k = HF hidden_states[k+1])")
    else:
        notes.append(f"SGLang {rel.version} turns its EAGLE-3 capture on only with a draft model: forward hooks on "
                     f"decoder layers {[i - 1 for i in layer_ids]} compute the same hidden_states + residual")
    hook_config = HookConfig(DumpSettings(dump_dir=dump_dir.resolve(), rid_prefix=dump_args.dump_rid_prefix,
                                          model=str(flags.model_path), layer_ids=layer_ids,
                                          max_pending_bytes=dump_args.dump_max_pending_bytes,
                                          max_dir_bytes=dump_args.dump_max_bytes,
                                          writer_threads=dump_args.dump_writer_threads,
                                          instance=dump_args.dump_instance or uuid.uuid4().hex),
                             aux_capture=rel.aux_capture)
    hooks = (json.loads(flags.forward_hooks) if flags.forward_hooks else []) + forward_hook_specs(hook_config)
    argv += ["--forward-hooks", json.dumps(hooks)]
    notes.append(f"added --forward-hooks: dumps of rids {dump_args.dump_rid_prefix!r}* to {hook_config.dump.dump_dir}, "
                 f"aux layers {list(layer_ids)}" + (" (merged with the given hooks)" if flags.forward_hooks else ""))

    notes.append(f"tp {flags.tp_size}, dp {flags.dp_size}: attention-TP rank 0 of each DP rank writes its own requests")
    if flags.chunked_prefill_size is not None:
        notes.append(f"--chunked-prefill-size {flags.chunked_prefill_size} is fine: each chunk is written with its offset")
    if flags.enable_mixed_chunk:
        notes.append("--enable-mixed-chunk is fine: decode rows in an extend batch are not dumped")
    if not flags.skip_server_warmup:
        notes.append("warmup and health checks run but are not dumped: their rids lack the prefix")
    if not flags.disable_radix_cache:
        notes.append("radix cache on: a prefix-cache hit leaves the prompt's head undumped (the reader reports it); "
                     "send a unique extra_key per request or pass --disable-radix-cache")
    return LaunchPlan(argv, hook_config, notes)


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    """argv without ``flag VALUE`` / ``flag=VALUE``."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok == flag:
            skip = True
        elif not tok.startswith(flag + "="):
            out.append(tok)
    return out


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def child_env(environ: dict[str, str]) -> dict[str, str]:
    """The server's environment: the project first on PYTHONPATH, so every subprocess imports ``patches``."""
    env = dict(environ)
    parts = [str(PROJECT_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        dump_arg_parser().error("put the sglang.launch_server arguments after --")
    split = argv.index("--")
    dump_args = dump_arg_parser().parse_args(argv[:split])
    try:
        rel = release(installed_sglang_version())
        plan = plan_launch(rel, dump_args, argv[split + 1:])
    except (LaunchRefused, RuntimeError) as exc:
        sys.exit(f"patches.launch: {exc}")
    for note in plan.notes:
        print(f"patches.launch: {note}", file=sys.stderr)
    key = os.environ.get(API_KEY_ENV)
    if not key:
        cmd = [sys.executable, "-m", "sglang.launch_server", *plan.argv]
        print(f"patches.launch: SGLang {rel.version}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        os.execve(sys.executable, cmd, child_env(dict(os.environ)))
    cmd = [sys.executable, "-m", "patches.sglang_serve", *plan.argv]
    print(f"patches.launch: SGLang {rel.version}: {shlex.join(cmd)} (API key from {API_KEY_ENV}; its output "
          f"shows it as ***)", file=sys.stderr, flush=True)
    code = run_redacting(cmd, child_env(dict(os.environ)), key)
    if code < 0:  # end as SGLang ended, so that a supervisor records the same exit
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def run_redacting(cmd: list[str], env: dict[str, str], secret: str) -> int:
    """Run ``cmd`` (same process group) with its output copied to ours, ``secret`` replaced by ``***``;
    its exit code. SIGTERM/SIGINT sent to this process alone (a supervisor's terminate) are passed on."""
    child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: child.poll() is None and child.send_signal(signum))
    secret_bytes, out = secret.encode(), sys.stdout.buffer
    for line in child.stdout:  # until every process holding the pipe (SGLang's subprocesses too) is gone
        out.write(line.replace(secret_bytes, b"***"))
        out.flush()
    return child.wait()


if __name__ == "__main__":
    main()

"""What runs on a GPU node imports with what SGLang brings (torch, safetensors, requests).

Checked in a fresh interpreter whose import system refuses the packages a node lacks, so a
module-level import of any of them anywhere in the chain fails the test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NODE_MODULES = ["patches.dumps", "patches.sglang_hook", "patches.launch", "tasks.retrieval", "tasks.shards",
                "tasks.node_batch", "tasks.readers", "infra.node_agent", "infra.dump_stream", "infra.local_server", "tasks.dataset_version"]
ABSENT_ON_NODES = ["prefect", "polars", "paramiko", "jinja2", "pydantic"]


def test_extraction_core_imports_without_the_flow_machines_packages():
    code = textwrap.dedent(f"""
        import importlib, sys
        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {ABSENT_ON_NODES!r}:
                    raise ImportError(f"{{name}} is not on a GPU node")
        sys.meta_path.insert(0, Refuse())
        for module in {NODE_MODULES!r}:
            importlib.import_module(module)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"

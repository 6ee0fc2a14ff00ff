"""Every SGLang symbol the dump hook and the launcher rely on exists in each supported release.

The releases' wheels are downloaded once (``pip download --no-deps``, cached in
build/sglang-src/<version>/, ignored by git) and unpacked; their source is parsed with
``ast``, never imported (SGLang needs a GPU stack). The symbols are the ones listed in
patches/sglang_releases.py, and the hook's own attribute reads are checked to be listed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from functools import cached_property
from pathlib import Path

import pytest

from patches import launch, sglang_hook
from patches.sglang_releases import SERVER_ARGS, SUPPORTED_RELEASES, SYMBOLS, Symbol

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE = REPO_ROOT / "build" / "sglang-src"
#: The wheel's Python source is the same on every platform; pin one tag so the cache is stable.
WHEEL_TAGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
              *(a for tag in ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64")
                for a in ("--platform", tag))]


def unpacked_release(version: str) -> Path:
    root = CACHE / version
    if (root / "sglang" / "srt").is_dir():
        return root
    root.mkdir(parents=True, exist_ok=True)
    wheels = list(root.glob("sglang-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *WHEEL_TAGS, f"sglang=={version}", "-d", str(root)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = list(root.glob("sglang-*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extractall(root, [n for n in zf.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    return root


class ReleaseSource:
    def __init__(self, version: str, root: Path):
        self.version, self.root = version, root
        self._trees: dict[str, ast.Module] = {}

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            path = self.root / (module.replace(".", "/") + ".py")
            if not path.is_file():  # a package: its __init__
                path = self.root / module.replace(".", "/") / "__init__.py"
            if not path.is_file():
                raise LookupError(f"SGLang {self.version}: no module {module} ({path})")
            self._trees[module] = ast.parse(path.read_text(), str(path))
        return self._trees[module]

    def find(self, module: str, qualname: str) -> ast.AST:
        node: ast.AST = self.tree(module)
        for part in qualname.split("."):
            found = [n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part]
            if not found:
                raise LookupError(f"SGLang {self.version}: {module} has no {qualname} (missing {part})")
            node = found[-1]
        return node

    @cached_property
    def server_arg_fields(self) -> dict[str, str]:
        """Server-argument field name -> source of its annotation (0.5.17: ServerArgs; later: arg_groups/fields)."""
        files = [self.root / "sglang/srt/server_args.py", *sorted((self.root / "sglang/srt/arg_groups/fields").glob("*.py"))]
        fields = {}
        for path in files:
            if not path.is_file():
                continue
            for cls in ast.walk(ast.parse(path.read_text())):
                if isinstance(cls, ast.ClassDef):
                    for stmt in cls.body:
                        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                            fields.setdefault(stmt.target.id, ast.unparse(stmt.annotation))
        return fields

    @cached_property
    def cli_options(self) -> set[str]:
        """Every option string the release's argument parser accepts: fields (not no_cli) and aliases."""
        opts = {"--" + name.replace("_", "-") for name, ann in self.server_arg_fields.items() if "no_cli=True" not in ann}
        for path in [self.root / "sglang/srt/server_args.py", *(self.root / "sglang/srt/arg_groups").rglob("*.py")]:
            if path.is_file():
                opts |= {n.value for n in ast.walk(ast.parse(path.read_text()))
                         if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("--")}
        return opts

    def check(self, sym: Symbol) -> None:
        if sym.kind == "flag":
            flag = "--" + sym.name.replace("_", "-")
            if sym.name not in self.server_arg_fields or flag not in self.cli_options:
                raise LookupError(f"SGLang {self.version}: no server flag {flag}")
            return
        if sym.kind in ("function", "source"):
            fn = self.find(sym.module, sym.name)
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                raise LookupError(f"SGLang {self.version}: {sym.module}.{sym.name} is not a function")
            if sym.kind == "function":
                names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
                if "." in sym.name and names and names[0] in ("self", "cls"):
                    names = names[1:]
                if tuple(names[:len(sym.params)]) != sym.params:
                    raise LookupError(f"SGLang {self.version}: {sym.name}{tuple(names)} does not start with {sym.params}")
            else:
                try:
                    snippet = ast.unparse(ast.parse(sym.snippet))
                except SyntaxError:
                    snippet = sym.snippet
                if snippet not in ast.unparse(fn):
                    raise LookupError(f"SGLang {self.version}: {sym.name} no longer contains {snippet!r}")
            return
        cls_name, attr = sym.name.rsplit(".", 1)
        cls = self.find(sym.module, cls_name)
        assigned = set()
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                assigned.add(stmt.target.id)
            elif isinstance(stmt, ast.Assign):
                assigned |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        if sym.kind == "field":
            for node in ast.walk(cls):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
                targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                assigned |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                             and isinstance(t.value, ast.Name) and t.value.id == "self"}
        if attr not in assigned:
            raise LookupError(f"SGLang {self.version}: {cls_name} has no {sym.kind} {attr}")


@pytest.fixture(scope="session", params=sorted(SUPPORTED_RELEASES))
def source(request) -> ReleaseSource:
    return ReleaseSource(request.param, unpacked_release(request.param))


def test_every_relied_upon_symbol_exists_in_each_supported_release(source):
    missing = []
    for sym in SYMBOLS:
        if sym.applies_to(source.version):
            try:
                source.check(sym)
            except LookupError as exc:
                missing.append(f"{exc} (needed because: {sym.why})")
    assert not missing, "\n".join(missing)


def test_supported_architectures_call_the_logits_processor_with_aux_fifth(source):
    modules = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
    snippet = ast.unparse(ast.parse(
        "self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, aux_hidden_states)"))
    for arch in SUPPORTED_RELEASES[source.version].architectures:
        fn = source.find(f"sglang.srt.models.{modules[arch]}", f"{arch}.forward")
        assert snippet in ast.unparse(fn), f"SGLang {source.version}: {arch}.forward calls its logits processor otherwise"
        source.find(f"sglang.srt.models.{modules[arch]}", f"{arch}.set_eagle3_layers_to_capture")


def test_forward_batch_takes_the_hooks_notes(source):
    """The hook notes prompts and aux states as attributes: ForwardBatch must stay a slot-less dataclass."""
    module = "sglang.srt.model_executor.forward_batch_info"
    cls = source.find(module, "ForwardBatch")
    assert [ast.unparse(d) for d in cls.decorator_list] == ["dataclass"]
    mixin = source.find("sglang.srt.model_executor.forward_batch_deepseek_mha_mixin", "ForwardBatchDeepSeekMHAMixin")
    for c in (cls, mixin):
        assert not any(isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "__slots__" for t in s.targets)
                       for s in c.body), f"SGLang {source.version}: {c.name} declares __slots__"


def test_launcher_emits_only_flags_the_release_accepts(source, tmp_path):
    rel = SUPPORTED_RELEASES[source.version]
    args = launch.dump_arg_parser().parse_args(["--dump-dir", str(tmp_path)])
    plan = launch.plan_launch(rel, args, ["--model-path", "/models/m", "--tp-size", "2"], model=(rel.architectures[0], 32))
    emitted = {tok.split("=")[0] for tok in plan.argv if tok.startswith("--")}
    assert emitted <= source.cli_options, emitted - source.cli_options


def test_launcher_reads_only_options_some_release_defines():
    sources = [ReleaseSource(v, unpacked_release(v)) for v in sorted(SUPPORTED_RELEASES)]
    read = {opt for action in launch._server_flag_parser()._actions for opt in action.option_strings}
    unknown = {opt for opt in read if not any(opt in s.cli_options for s in sources)}
    assert not unknown, f"patches.launch parses options no supported SGLang has: {unknown}"


def _attribute_reads(tree: ast.AST, var: str) -> set[str]:
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == var}


def test_the_hooks_attribute_reads_are_all_listed_symbols():
    """The list in sglang_releases.py is what the hook uses: a new read must be listed (and so checked)."""
    tree = ast.parse(Path(sglang_hook.__file__).read_text())
    listed = {sym.name for sym in SYMBOLS}
    own = {"__dict__"}  # the aux states go through __dict__ with AUX_ATTR
    for var, cls in (("forward_batch", "ForwardBatch"), ("req", "Req"), ("batch", "ScheduleBatch")):
        reads = _attribute_reads(tree, var) - own
        assert reads, f"the hook reads nothing from {var}: the scan is broken"
        unlisted = {f"{cls}.{a}" for a in reads} - listed
        assert not unlisted, f"patches/sglang_hook.py reads {unlisted}, not in SYMBOLS"
    for attr in ("init_new",):
        assert f"ForwardBatch.{attr}" in listed
    assert {"get_attn_tensor_model_parallel_rank"} <= _attribute_reads(tree, "parallel_state")
    assert {s.name for s in SYMBOLS if s.module == SERVER_ARGS} >= {
        "forward_hooks", "disable_prefill_cuda_graph", "enable_return_aux_hidden_states"}


def test_a_release_that_moves_a_symbol_fails_the_check(tmp_path):
    """The checker is not vacuous: the same symbols against a doctored copy of one module fail."""
    version = sorted(SUPPORTED_RELEASES)[0]
    real = unpacked_release(version)
    fake = tmp_path / "sglang/srt/model_executor"
    fake.mkdir(parents=True)
    text = (real / "sglang/srt/model_executor/hook_manager.py").read_text()
    (fake / "hook_manager.py").write_text(text.replace("def register_forward_hooks(model", "def register_hooks(model"))
    doctored = ReleaseSource(version, tmp_path)
    sym = next(s for s in SYMBOLS if s.name == "register_forward_hooks" and s.kind == "function")
    with pytest.raises(LookupError, match="register_forward_hooks"):
        doctored.check(sym)

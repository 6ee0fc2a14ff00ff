"""Dataset versions: everything that changes the tensors of a sample is in the fingerprint.

``{out}/versions/{fingerprint}/`` holds one dataset version: another model, layer set,
dtype, chat template, template variable (the date a template writes, enable_thinking, any
chat_template_kwargs) or length rule is another folder, never mixed into this one.
Within a version a sample is identified by its content key, so a re-run extracts only
the keys that no finished shard holds yet. ``{out}/latest`` links to the version of the last
run that completed (tasks.training_set.point_latest).

One run writes a version folder at a time: :func:`version_lock` holds an OS lock
(``flock``) on ``run.lock`` in it for the whole run. The kernel drops the lock with the
process, so a killed run never leaves a stale one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from patches.dumps import FINAL_STATES, LAYER_CONVENTION, default_aux_layer_ids

#: Bumped when the training-set layout or the meaning of a field changes.
SCHEMA_VERSION = 2  # 2: the pre-norm final state beside the post-norm one


@dataclass(frozen=True)
class ModelFacts:
    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    identity: str  # content hash of config, tokenizer and weight files (see model_identity)


def read_model_facts(model_path: Path) -> ModelFacts:
    config = json.loads((model_path / "config.json").read_text())
    config = config.get("text_config", config)
    return ModelFacts(name=model_path.name, num_layers=int(config["num_hidden_layers"]),
                      hidden_size=int(config["hidden_size"]), vocab_size=int(config["vocab_size"]),
                      identity=model_identity(model_path))


def model_identity(model_path: Path, tail_bytes: int = 1 << 20) -> str:
    """Hash of the model's small files whole and of each weight file's size, header and tail.

    Reading every weight byte of a 70B model would take minutes per run; the safetensors
    header (names, shapes, dtypes, offsets) plus the last MiB tells apart any two
    checkpoints met in practice.
    """
    h = hashlib.sha256()
    for path in sorted(p for p in model_path.iterdir() if p.is_file()):
        h.update(path.name.encode())
        size = path.stat().st_size
        h.update(str(size).encode())
        with open(path, "rb") as f:
            if size <= 4 * tail_bytes:
                h.update(f.read())
                continue
            h.update(f.read(tail_bytes))
            f.seek(size - tail_bytes)
            h.update(f.read())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class ExtractionConfig:
    model_identity: str
    layer_ids: tuple[int, ...]
    layer_convention: str
    final_states: str       # patches.dumps.FINAL_STATES: which final states the samples hold
    dtype: str
    store_dtype: str        # dtype, or a quantized storage dtype (tasks.shards.QUANTIZED_DTYPES)
    template_hash: str
    max_length: int
    on_overlong: str
    template_variables: dict  # TemplateVariables.record(): a changed date or kwarg changes the ids
    schema_version: int = SCHEMA_VERSION

    def fingerprint(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def extraction_config(model: ModelFacts, layer_ids: list[int] | None, dtype: str, template_hash: str,
                      max_length: int, on_overlong: str, store_dtype: str | None = None, *,
                      template_variables: dict) -> ExtractionConfig:
    layers = tuple(layer_ids) if layer_ids else tuple(default_aux_layer_ids(model.num_layers))
    # hidden_states[N] is the final state after the norm, not a residual stream: not an aux tap.
    bad = [i for i in layers if not 1 <= i < model.num_layers]
    if bad or len(set(layers)) != len(layers):
        raise ValueError(f"aux layer ids {list(layers)} must be distinct HF hidden_states indices in "
                         f"1..{model.num_layers - 1} (model {model.name} has {model.num_layers} layers)")
    return ExtractionConfig(model.identity, layers, LAYER_CONVENTION, FINAL_STATES, dtype, store_dtype or dtype,
                            template_hash, max_length, on_overlong, template_variables)


def version_dir(out: Path, config: ExtractionConfig) -> Path:
    return out / "versions" / config.fingerprint()


# --------------------------------------------------------------------------- one run per version folder

LOCK_NAME = "run.lock"


def lock_holder(**what: str) -> dict:
    """Who holds a version lock, as written into the lock file: ``what`` (the run) and this process."""
    return {**what, "pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}


class VersionBusy(RuntimeError):
    """Another run writes the dataset version folder; the message names the folder and that run."""


@contextlib.contextmanager
def version_lock(vdir: Path, holder: dict, wait_s: float = 0.0,
                 on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold ``vdir``'s lock while the block runs; ``holder`` (:func:`lock_holder`) is written into the
    lock file so that a run refused meanwhile can name it. Another run holding it: wait up to
    ``wait_s`` (``on_wait(holder of the other run)`` once), then raise :class:`VersionBusy`."""
    path = vdir / LOCK_NAME
    with open(path, "a+") as f:
        deadline, waiting = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                other = path.read_text().strip() or "a run that has not written its name yet"
                if time.monotonic() >= deadline:
                    raise VersionBusy(f"dataset version folder {vdir} is being written by another run: {other}; "
                                      f"{'waited ' + format(wait_s, '.0f') + ' s; ' if wait_s else ''}"
                                      f"try again when it has finished (or give --version-wait-s)") from None
                if not waiting and on_wait is not None:
                    on_wait(other)
                waiting = True
                time.sleep(0.2)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(holder) + "\n")
        f.flush()
        yield

"""The command line is derived from ExtractParameters: every field has a flag, --help documents it,
and flags parse back to exactly the parameters they were written from."""

import json
import subprocess
import sys

import pytest
from pydantic import BaseModel

from flows.cli import model_options
from flows.extract import CLI, parse_args
from flows.parameters import REPO, ExtractParameters, NodeOptions, ServerOptions


def leaf_fields(model, prefix=()):
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from leaf_fields(field.annotation, prefix + (name,))
        else:
            yield prefix + (name,), field


def test_every_field_has_a_title_a_description_and_a_documented_flag():
    help_text = subprocess.run([sys.executable, "-m", "flows.extract", "--help"], cwd=REPO, capture_output=True,
                               text=True, check=True, timeout=120).stdout
    flat = "".join(help_text.split())  # argparse wraps lines (at spaces and hyphens)
    flags = {o.path: o.flag for o in CLI.options}
    fields = list(leaf_fields(ExtractParameters))
    assert len(fields) == len(model_options(ExtractParameters)) > 35
    for path, field in fields:
        assert field.title and not field.title.startswith("--"), f"{path}: title {field.title!r}"
        assert field.description and field.description.strip(), f"{path}: no description"
        assert "".join(field.description.split()) in flat, f"{path}: description missing from --help"
        if path == ("server", "extra_args"):
            assert "-- ARGS..." in help_text  # the server's own flags go after --
        else:
            assert flags[path] in help_text, f"{path}: no flag"
    assert "(default:100;>=1,<=5000)" in flat  # --batch-size: default and bounds


def test_the_flags_of_earlier_releases_still_parse():
    """The flags the README, the tests and users' scripts use."""
    params = parse_args(["--prompts", "p.jsonl", "--model-path", "m", "--out", "o", "--batch-size", "3",
                         "--max-in-flight", "1", "--concurrent-batches", "1", "--aux-layers", "1", "2", "3",
                         "--exports", "specforge", "modelopt", "--disable-radix-cache", "--fetch",
                         "--node", "ssh://u@h:2222", "--ssh-key", "k", "--known-hosts", "kh", "--node-python", "py",
                         "--node-workdir", "w", "--node-dump-dir", "d", "--shards-on", "node", "--lease-timeout-s",
                         "4", "--chunked-prefill-size", "24", "--engine", "sglang", "--no-enable-thinking",
                         "--", "--tp-size", "2"])
    assert params == ExtractParameters(
        prompts="p.jsonl", model_path="m", out="o", batch_size=3, max_in_flight=1, concurrent_batches=1,
        aux_layers=[1, 2, 3], exports=["specforge", "modelopt"], enable_thinking=False,
        server=ServerOptions(disable_radix_cache=True, chunked_prefill_size=24, engine="sglang",
                             extra_args=["--tp-size", "2"]),
        node=NodeOptions(fetch=True, node="ssh://u@h:2222", ssh_key="k", known_hosts="kh", python="py", workdir="w",
                         dump_dir="d", shards_on="node", lease_timeout_s=4))
    assert parse_args([]) == ExtractParameters()


def as_flags(params: ExtractParameters) -> list[str]:
    """The command line that asks for ``params``: every field, written out."""
    argv, rest = [], []
    data = params.model_dump()
    for option in CLI.options:
        value = data
        for part in option.path:
            value = value[part]
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(option.flag if value else "--no-" + option.flag[2:])
        elif isinstance(value, list):
            argv += [option.flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [option.flag, json.dumps(value)]
        else:
            argv += [option.flag, str(value)]
    rest = params.server.extra_args
    return argv + (["--", *rest] if rest else [])


@pytest.mark.parametrize("params", [
    ExtractParameters(),
    ExtractParameters(
        prompts="/data/prompts/*.jsonl", model_path="/models/x", out="/tmp/o", batch_size=7, max_in_flight=3,
        max_dump_bytes_in_flight=1 << 24, concurrent_batches=5, attempts=4, sample_retries=0, backoff_s=0.25,
        server_restarts=1, max_failed_fraction=0.5, version_wait_s=7.5, max_length=99, on_overlong="skip", aux_layers=[0, 5, 9],
        dtype="bfloat16", exports=["speculators"], store_dtype="float8_e4m3fn", draft_vocab_size=64,
        template_date="2025-03-04", enable_thinking=False, chat_template_kwargs={"reasoning_effort": "high", "n": 2},
        server=ServerOptions(engine="sglang", chunked_prefill_size=-1, disable_radix_cache=True,
                             skip_server_warmup=True, device="cuda", port=31000,
                             api_key_file="/run/secrets/k", ready_timeout_s=12.5, allow_non_loopback=True,
                             extra_args=["--tp-size", "2", "--mem-fraction-static", "0.8", "--host", "0.0.0.0"]),
        node=NodeOptions(node="ssh://me@gpu:22", block="gpu-a", ssh_key="~/.ssh/k", known_hosts="/kh",
                         python="/opt/py", workdir="/scratch/w", dump_dir="/dev/shm/d", shards_on="node", fetch=True,
                         lease_timeout_s=30)),
], ids=["defaults", "every-field-changed"])
def test_flags_round_trip_to_the_same_parameters(params):
    assert parse_args(as_flags(params)) == params


@pytest.mark.parametrize("engine", ["transformers", "sglang"])
def test_server_flags_cannot_open_the_server_beyond_loopback_or_carry_the_key(engine, capsys):
    """Both engines: --host beyond loopback is refused without --allow-non-loopback; a key among the
    server's flags is refused always (every user of the host would see it in ps)."""
    for extra, why in ((["--host", "0.0.0.0"], "listen beyond loopback (0.0.0.0)"),
                       (["--host=10.1.2.3"], "listen beyond loopback (10.1.2.3)"),
                       (["--config", "c.yaml"], "whatever --config c.yaml sets"),
                       (["--ho", "0.0.0.0"], "listen beyond loopback (0.0.0.0)"),  # argparse takes prefixes
                       (["--api-key", "s3cret"], "--api-key among the server's flags"),
                       (["--api-k=s3cret"], "--api-key among the server's flags")):
        with pytest.raises(SystemExit):
            parse_args(["--engine", engine, "--", *extra])
        err = capsys.readouterr().err
        assert why in err and "s3cret" not in err, err
    for host in ("127.0.0.1", "localhost", "::1"):
        assert parse_args(["--engine", engine, "--", "--host", host]).server.extra_args == ["--host", host]
    opened = parse_args(["--engine", engine, "--allow-non-loopback", "--", "--host", "0.0.0.0"])
    assert opened.server.allow_non_loopback and opened.server.extra_args == ["--host", "0.0.0.0"]
    with pytest.raises(SystemExit):
        parse_args(["--allow-non-loopback", "--", "--api-key=s3cret"])
    assert "s3cret" not in capsys.readouterr().err


def test_a_bad_value_is_a_usage_error_naming_the_flag():
    run = subprocess.run([sys.executable, "-m", "flows.extract", "--batch-size", "0", "--lease-timeout-s", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "--batch-size: Input should be greater than or equal to 1" in run.stderr
    assert "--lease-timeout-s: Input should be greater than or equal to 2" in run.stderr

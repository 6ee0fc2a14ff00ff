"""The extraction flow's parameters: one pydantic model, from which the command line
(``flows.cli``), the deployments' forms in the Prefect UI and their validation all come."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from infra.node_block import SshNodeBlock
from infra.server import check_server_args
from infra.ssh import SshSettings, parse_node_url
from patches.launch import API_KEY_ENV
from tasks.chat_template import DEFAULT_ENABLE_THINKING, DEFAULT_TEMPLATE_DATE, TemplateVariables


REPO = Path(__file__).resolve().parent.parent
DEMO_PROMPTS = REPO / "data" / "demo_prompts.jsonl"


class ServerOptions(BaseModel):
    """How the model server is run (flags under SGLang's names)."""

    engine: Literal["transformers", "sglang"] = Field(
        "transformers", title="Server engine",
        description="transformers: the project's own server (a Hugging Face forward, CPU or GPU); "
                    "sglang: real SGLang with the dump patch (patches.launch), on a GPU node.")
    chunked_prefill_size: int | None = Field(None, title="Chunked prefill size", ge=-1,
                                             description="Prefill tokens per forward; -1 disables chunking; "
                                                         "empty: the server's default.")
    disable_radix_cache: bool = Field(False, title="Disable the radix cache",
                                      description="Every request is prefilled in full, no prefix reuse.")
    skip_server_warmup: bool = Field(False, title="Skip the server's warm-up",
                                     description="Start faster; the first requests pay for it.")
    device: Literal["cpu", "cuda"] | None = Field(None, title="Device",
                                                  description="Empty: cpu for the transformers engine, cuda for "
                                                              "sglang.")
    port: int = Field(0, title="Server port", ge=0, le=65535,
                      description="Loopback port of the server; 0 picks a free one.")
    api_key_block: str | None = Field(None, title="API key: Prefect Secret block",
                                      description="Name of a saved Prefect Secret block holding the key the server "
                                                  "requires on every request (or a file, next; or the "
                                                  f"{API_KEY_ENV} environment variable; none: no key).")
    api_key_file: str | None = Field(None, title="API key: file",
                                     description="A file on the flow's machine holding the server's key (its path "
                                                 "is the parameter, never the key).")
    ready_timeout_s: float = Field(300.0, title="Start-up timeout (s)", gt=0, le=86400,
                                   description="How long to wait for the server's /health before giving up.")
    health_timeout_s: float = Field(30.0, title="Health-check timeout (s)", gt=0, le=3600,
                                    description="While batches run the server's /health is checked; unanswered "
                                                "within this twice in a row, the server is hung: it is killed and "
                                                "restarted (--server-restarts). Above SGLang's own 20 s.")
    extra_args: list[str] = Field([], title="More server flags",
                                  description="Passed to the server as they are (after -- on the command line); "
                                              "never --api-key (see above).")
    allow_non_loopback: bool = Field(False, title="Allow listening beyond loopback",
                                     description="Let the flags above make the server listen on other interfaces "
                                                 "(--host 0.0.0.0): anyone who reaches the host can then use it. "
                                                 "Refused without this; logged with it.")

    @model_validator(mode="after")
    def _safe_server_args(self) -> "ServerOptions":
        if self.api_key_block and self.api_key_file:
            raise ValueError("give the API key one way: --api-key-block or --api-key-file")
        check_server_args(self.extra_args, self.allow_non_loopback)
        return self

    @property
    def device_or_default(self) -> str:
        return self.device or ("cuda" if self.engine == "sglang" else "cpu")


class NodeOptions(BaseModel):
    """Where the server runs: this machine, or a GPU node over SSH (paths are the node's)."""

    node: str = Field("local", title="GPU node", description="local (this machine), or ssh://USER@HOST[:PORT].")
    block: str | None = Field(None, title="Saved node block",
                              description="A saved eagle3-ssh-node block; replaces node, key, known_hosts, "
                                          "python, workdir and dump folder below.")
    ssh_key: str | None = Field(None, title="SSH private key file",
                                description="A file on this machine (required for an ssh:// node without a block).")
    known_hosts: str = Field("~/.ssh/known_hosts", title="Known hosts file",
                             description="The node's host key must be in it; an unknown key is refused.")
    python: str = Field("python3", title="Python on the node",
                        description="Interpreter that runs the node agent and the server.")
    workdir: str = Field("eagle3-extract", title="Work folder on the node",
                         description="Code, servers and node-side shards; relative: under the node's home.")
    dump_dir: str | None = Field(None, title="Dump folder on the node",
                                 description="Where the server writes hidden states; empty: <workdir>/dumps.")
    shards_on: Literal["here", "node"] | None = Field(
        None, title="Where shards are written",
        description="node (the default for an SSH node: README says why): batches run and shards stay there; "
                    "here: requests through a tunnel, dumps read over the connection.")
    fetch: bool = Field(False, title="Fetch the shards",
                        description="Bring the node's shards home after the run and make the exports here.")
    lease_timeout_s: float = Field(60.0, title="Server lease (s)", ge=2, le=3600,
                                   description="A server whose lease the flow stops renewing stops after this.")

    @model_validator(mode="after")
    def _node_flags_need_a_node(self) -> "NodeOptions":
        if not self.remote and (self.shards_on or self.fetch):
            raise ValueError("--shards-on and --fetch apply to an SSH node (--node ssh://... or --node-block)")
        if self.fetch and self.shards_on == "here":
            raise ValueError("--fetch brings home shards written on the node; with --shards-on here they are here")
        return self

    @property
    def remote(self) -> bool:
        return self.node != "local" or self.block is not None

    @property
    def shards_remote(self) -> bool:
        return self.remote and self.shards_on != "here"

    def host_name(self) -> str:
        """The machine the server runs on, as its concurrency limit is named (infra/node_slot.py)."""
        return self.ssh_settings().host if self.remote else socket.gethostname()

    def ssh_settings(self) -> SshSettings:
        if self.block:
            return SshNodeBlock.load(self.block).settings()
        user, host, port = parse_node_url(self.node)
        return SshSettings(user=user, host=host, port=port, known_hosts=Path(self.known_hosts),
                           key_path=Path(self.ssh_key) if self.ssh_key else None, python=self.python,
                           workdir=self.workdir, dump_dir=self.dump_dir)


class ExtractParameters(BaseModel):
    """One extraction: which prompts through which model into which folder, and how."""

    prompts: str = Field(str(DEMO_PROMPTS), title="Prompts",
                         description="A JSONL, JSON or Parquet file, or a folder or glob of them (read in name "
                                     "order; a nightly run picks up files added since).")
    model_path: str | None = Field(None, title="Model folder",
                                   description="A local Hugging Face model folder (on the node with an SSH node); "
                                               "empty: the tiny demo model.")
    out: str = Field("out", title="Output folder",
                     description="Dataset versions, dumps and run records go under it.")
    server: ServerOptions = Field(default_factory=ServerOptions, title="Server")
    node: NodeOptions = Field(default_factory=NodeOptions, title="Node")
    batch_size: int = Field(100, title="Samples per batch task", ge=1, le=5000,
                            description="One task run and one shard per batch; keeps the flow-run graph small.")
    max_in_flight: int = Field(8, title="Requests in flight", ge=1, le=1024,
                               description="Requests sent to the server and not yet answered, over all batches.")
    max_dump_bytes_in_flight: int = Field(
        2 << 30, title="Dump bytes in flight", ge=1 << 20, le=1 << 40,
        description="Hidden-state bytes of requests sent but not yet read back, over all batches: a slow reader "
                    "slows the server instead of losing dumps. The server's dump writer gets twice this as its "
                    "budget. 64 requests of 2k tokens at hidden 4096 take ~5.4 GB.")
    reader_processes: int | None = Field(
        None, title="Dump reader processes", ge=0, le=256,
        description="Processes that read, verify and write the dumps into shards, on the machine that reads them "
                    "(the node with shards on the node); empty: half its cores; 0: the request threads do it. "
                    "One reads ~0.5-1 GB/s beside a busy server: an H200 at hidden 4096 makes ~3.3 GB/s of dumps. "
                    "Each keeps a buffer of the largest sample it has read.")
    concurrent_batches: int = Field(2, title="Batch tasks at once", ge=1, le=64,
                                    description="Batch tasks running at the same time.")
    version_wait_s: float = Field(0.0, title="Wait for another run on the version (s)", ge=0, le=86400,
                                  description="Another run writing the same dataset version folder: wait this long "
                                              "for it to finish, then refuse; 0: refuse at once.")
    attempts: int = Field(3, title="Attempts per sample inside its batch", ge=1, le=20,
                          description="A sample that fails this often goes to its own retry task.")
    sample_retries: int = Field(2, title="Retries of a straggler", ge=0, le=20,
                                description="Prefect retries of a sample its batch could not extract, in its "
                                            "own sample-<id> task.")
    backoff_s: float = Field(0.5, title="Seconds before the first retry", ge=0, le=600,
                             description="Doubles with each retry, inside a batch and in a sample's own task.")
    server_restarts: int = Field(2, title="Server restarts", ge=0, le=20,
                                 description="A server that dies mid-run is restarted this often (with its log "
                                             "tail in the run log); the samples it had not finished go on.")
    max_failed_fraction: float = Field(
        0.01, title="Failed samples allowed (fraction)", ge=0, le=1,
        description="Past it the run fails (a Failed flow run, exit code 1) instead of retrying each sample in "
                    "its own task; failed samples are recorded either way.")
    max_length: int = Field(2048, title="Max tokens per sample", ge=2, le=1 << 20,
                            description="Longer samples are truncated or skipped (next option).")
    on_overlong: Literal["truncate", "skip"] = Field("truncate", title="Overlong samples",
                                                     description="truncate to the max length, or skip them "
                                                                 "(listed in rejects.jsonl).")
    aux_layers: list[int] | None = Field(None, title="Aux layers", min_length=3, max_length=3,
                                         description="Three HF hidden_states indices; empty: the EAGLE-3 default "
                                                     "[2, N//2, N-3]. Part of the version.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", title="Model dtype",
                                                              description="The server's compute dtype and the "
                                                                          "stored hidden states' dtype.")
    exports: list[Literal["specforge", "speculators", "modelopt"]] = Field(
        [], title="Trainer exports", description="Written next to the shards, a second copy of the data; "
                                                 "`python -m tasks.exports` writes them on demand instead.")
    store_dtype: Literal["float8_e4m3fn"] | None = Field(
        None, title="Stored dtype", description="Empty: store the hidden states in the model dtype; "
                                                "float8_e4m3fn: half of bf16's bytes, per-token scales (README).")
    draft_vocab_size: int | None = Field(None, title="Draft vocabulary size", ge=1,
                                         description="Draft vocabulary of the d2t/t2d mapping; empty: 32000, "
                                                     "or the target's vocabulary when smaller.")
    template_date: str = Field(DEFAULT_TEMPLATE_DATE, title="Date the chat template writes (YYYY-MM-DD)",
                               pattern=r"^\d{4}-\d{2}-\d{2}$",
                               description="What templates that write today's date (Llama 3.x, gpt-oss) see, "
                                           "fixed so every night gives the same ids. Part of the version.")
    enable_thinking: bool = Field(DEFAULT_ENABLE_THINKING, title="Enable thinking (chat template variable)",
                                  description="Qwen3 and others; part of the version.")
    chat_template_kwargs: dict[str, Any] = Field({}, title="More chat template variables (JSON)",
                                                 description="Passed to the template; part of the version.")
    retry_failed_of: str | None = Field(
        None, title="Retry the failed samples of version", pattern=r"^[0-9a-f]{16}$",
        description="A dataset version (16 hex digits): extract only the samples its runs recorded as failed "
                    "and not written since, into it, nothing new; the other parameters must give that version.")

    def template_variables(self) -> TemplateVariables:
        return TemplateVariables(self.template_date, self.enable_thinking, self.chat_template_kwargs)


def failure_budget(params: ExtractParameters, samples: int) -> int:
    return int(params.max_failed_fraction * samples)

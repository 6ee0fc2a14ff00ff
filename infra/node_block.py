"""The SSH node settings as a Prefect Block: saved once (key encrypted), chosen by name.

    from infra.node_block import SshNodeBlock
    SshNodeBlock(node="ssh://me@gpu-node:22", ssh_key=open(KEY).read(), known_hosts="~/.ssh/known_hosts",
                 api_key_block="gpu-node-key").save("gpu-node")   # optional: a Secret block's name
    python -m flows.extract --node-block gpu-node ...

or create it from the UI's Blocks page once registered (``prefect block register -m infra.node_block``).
"""

from __future__ import annotations

from pathlib import Path

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

from infra.ssh import SshSettings, parse_node_url


class SshNodeBlock(Block):
    """A GPU node reached over SSH, for the extract-eagle3 flow."""

    _block_type_name = "eagle3 SSH node"
    _block_type_slug = "eagle3-ssh-node"

    node: str = Field(..., title="Node", description="ssh://USER@HOST[:PORT]")
    ssh_key: SecretStr = Field(..., title="SSH private key", description="The key's text (unencrypted).")
    known_hosts: str = Field("~/.ssh/known_hosts", title="known_hosts file",
                             description="On the machine that runs the flow; the node's host key must be in it.")
    python: str = Field("python3", title="Python on the node")
    workdir: str = Field("eagle3-extract", title="Work folder on the node", description="Relative: under home.")
    dump_dir: str | None = Field(None, title="Dump folder on the node", description="Empty: <workdir>/dumps.")
    api_key_block: str | None = Field(None, title="API key: Prefect Secret block",
                                      description="Name of the Secret block holding the key its servers require "
                                                  "(the flow's --api-key-block overrides it).")

    def settings(self) -> SshSettings:
        user, host, port = parse_node_url(self.node)
        return SshSettings(user=user, host=host, port=port, known_hosts=Path(self.known_hosts),
                           key_text=self.ssh_key.get_secret_value(), python=self.python, workdir=self.workdir,
                           dump_dir=self.dump_dir)

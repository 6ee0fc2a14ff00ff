"""speculators' format: refused for data whose final state is after the norm.

speculators/models/eagle3/core.py computes
``targets = verifier_lm_head(verifier_norm(verifier_last_hidden_states))``: its trainer applies
the final norm itself. Our dumps hold the state after the norm; norming it twice gives wrong
target logits (the mismatch of speculators PR #313), and relabelling it as pre-norm would
mislead every other reader of that format. So there is no speculators export of such data.
"""

from __future__ import annotations

from tasks.exports.writer import ExportUnsupported
from tasks.training_set import DatasetInfo


def check_speculators(info: DatasetInfo) -> None:
    raise ExportUnsupported(
        f"speculators export of dataset version {info.fingerprint}: speculators stores the final layer's state "
        f"BEFORE the model's final norm and its trainer applies the norm; this version holds "
        f"final_norm={info.final_norm!r} states that cannot be un-normed. Use the 'specforge' or 'modelopt' "
        f"export, which take the post-norm state")

"""Which final states the dumps store: bytes per token against the error of a derived post-norm state.

    python -m bench.final_states [--hidden 1024] [--layers 4] [--prompts 32]

A trainer wants the last layer's output either after the model's final norm (SpecForge,
ModelOpt) or before it (speculators, which applies the norm itself). A dump can hold both,
or only the pre-norm state plus the norm's weights and eps, the post-norm one derived at
export. This runs the transformers engine's bf16 forward of a random tiny Llama (its final
norm's weights drawn around 1, as trained models' are) over the demo prompts and compares,
per token, the derived post-norm state with the one each engine serves:

- transformers: the norm of the bf16 pre-norm state (what ``hidden_states[-1]`` holds);
- SGLang: the fused add + norm kernel normalizes the fp32 sum of the last layer's residual
  and MLP output, never rounded to bf16 (``RMSNorm.forward_native`` / ``fused_add_rmsnorm``):
  emulated here from the two addends.

Printed as a markdown table: bytes per token of the final states at this width and at
H=4096, and the derived state's error (share of values that differ, max abs, mean and max
relative error per token, min cosine).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infra.tiny_model import build_tiny_model


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm of ``x`` (any float dtype), the output in the weight's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(weight.dtype)


def errors(derived: torch.Tensor, served: torch.Tensor) -> dict:
    d, s = derived.float(), served.float()
    rel = (d - s).norm(dim=-1) / s.norm(dim=-1).clamp_min(1e-30)
    return {"differ": float((d != s).float().mean()), "max_abs": float((d - s).abs().max()),
            "rel_mean": float(rel.mean()), "rel_max": float(rel.max()),
            "cos_min": float(torch.nn.functional.cosine_similarity(d, s, dim=-1).min())}


@torch.no_grad()
def measure(model_dir: Path, prompts: list[str]) -> tuple[dict, dict, int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    norm, last = model.model.norm, model.model.layers[-1]
    seen: dict[str, torch.Tensor] = {}
    hooks = [norm.register_forward_pre_hook(lambda m, args: seen.__setitem__("pre", args[0])),
             last.post_attention_layernorm.register_forward_pre_hook(lambda m, args: seen.__setitem__("res", args[0])),
             last.mlp.register_forward_hook(lambda m, args, out: seen.__setitem__("mlp", out))]
    pre, post, fused = [], [], []
    for text in prompts:
        out = model(torch.tensor([tok(text)["input_ids"]]), output_hidden_states=True)
        pre.append(seen["pre"][0])
        post.append(out.hidden_states[-1][0])
        fused.append(rms_norm(seen["res"][0].float() + seen["mlp"][0].float(), norm.weight, norm.variance_epsilon))
    for h in hooks:
        h.remove()
    pre, post, fused = torch.cat(pre), torch.cat(post), torch.cat(fused)
    derived = rms_norm(pre, norm.weight, norm.variance_epsilon)
    return errors(derived, post), errors(derived, fused), int(pre.shape[0])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.final_states", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32, help="demo conversations to run (all turns as one text)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    lines = Path(__file__).resolve().parent.parent.joinpath("data/demo_prompts.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[:a.prompts]]
    texts = [" ".join(str(m.get("content") or m.get("value") or "") for m in r.get("messages") or r["conversations"])
             for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(tmp, layers=a.layers, hidden=a.hidden, heads=a.hidden // 64,
                                     kv_heads=max(1, a.hidden // 256), seed=a.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        generator = torch.Generator().manual_seed(a.seed)
        with torch.no_grad():
            model.model.norm.weight.copy_(1 + 0.5 * torch.randn(a.hidden, generator=generator))
        model.save_pretrained(model_dir, safe_serialization=True)
        vs_hf, vs_fused, tokens = measure(model_dir, texts)
    print(f"{tokens:,} tokens, H={a.hidden}, bf16 forward (transformers, CPU), derived = RMSNorm(stored bf16 pre-norm)\n")
    print("| stored final states | final-state bytes/token (this H) | hidden-state bytes/token at H=4096 (3 taps "
          "+ final states, bf16) | derived post-norm vs | values differing | max abs error | rel. error mean "
          "| rel. error max | cosine min |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| post-norm + pre-norm (chosen) | {4 * a.hidden:,} | {(3 + 2) * 4096 * 2:,} | (both stored as served) "
          "| 0 | 0 | 0 | 0 | 1 |")
    for label, e in (("transformers' post-norm", vs_hf), ("SGLang's fused add+norm (emulated)", vs_fused)):
        print(f"| pre-norm + norm weights, post-norm derived | {2 * a.hidden:,} | {(3 + 1) * 4096 * 2:,} | {label} "
              f"| {e['differ']:.2%} | {e['max_abs']:.3g} | {e['rel_mean']:.2e} | {e['rel_max']:.2e} | {e['cos_min']:.6f} |")

if __name__ == "__main__":
    main()

"""The matmuls of a decode step alone, by operand order, weight layout and fusion.

Every projection of every layer and the LM head run on `rows` activation rows with the model's
own weights, in a jitted `fori_loop` of `--steps` steps, and nothing else (no attention, no
sampling). The variants:
- `w @ x`: through `jaxlm.ops.matmul`, as jaxlm runs them but for q/k/v and gate/up, which
  run as separate products: the weight `[out, in]` (PyTorch's layout) as the left operand, the
  activations feature-major `[in, rows]`;
- `w @ x one dot`: the same as one `dot_general` each, without `matmul`'s split of small
  matrix-vector products over the CPU's threads (and its padding of bf16 to 2 columns);
- `x @ w.T`: row-major activations `[rows, in]` as the left operand, the weight as stored as
  the right one (jaxlm before it went feature-major);
- `x @ w, [in,out]`: row-major activations and transposed weights `[in, out]`;
- `fused qkv, gate/up`: q, k and v concatenated into one `out,in` weight, gate and up into
  another, so a layer runs four matmuls instead of seven (as `w @ x`), as jaxlm stores them
  (`jaxlm.layers.MLP`, `jaxlm.models.llama.Attention`, whose q/k/v rows are grouped by KV
  head: the same product);
- `fused gate/up`: only gate and up concatenated.

The variants run interleaved, round by round, and the table gives each one's median and best
milliseconds per step and the weight bytes one step reads over the median time. Every variant
computes what `w @ x` computes (`max diff`, after one step). The weight copies of the other
layouts need about three times the model's weights in memory.

Usage: python benchmarks/matmul_step.py [--model PATH] [--dtype float32] [--rows 1,8] [--steps 16]
    [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.bench import OtherLoad, text_table
from jaxlm.loading import checkpoint_tensors
from jaxlm.ops import matmul

VARIANTS = (
    "w @ x",
    "w @ x one dot",
    "x @ w.T",
    "x @ w, [in,out]",
    "fused qkv, gate/up",
    "fused gate/up",
)
# The variants whose activations are row-major `[rows, features]`.
ROW_MAJOR = ("x @ w.T", "x @ w, [in,out]")


# The projections of a layer, by their names in `layer_weights` and in checkpoints.
_PROJECTIONS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def layer_weights(model) -> tuple[list[dict], jax.Array]:
    """Each layer's projection weights (`[out, in]`) and the LM head `[vocab, hidden]`."""
    tensors = checkpoint_tensors(model)
    layers = [
        {
            k: jnp.asarray(tensors[f"model.layers.{i}.{name}.weight"])
            for k, name in _PROJECTIONS.items()
        }
        for i in range(model.config.num_hidden_layers)
    ]
    head = "model.embed_tokens" if model.config.tie_word_embeddings else "lm_head"
    return layers, jnp.asarray(tensors[f"{head}.weight"])


def _variant_weights(variant: str, layers: list[dict], head: jax.Array):
    if variant == "x @ w, [in,out]":
        return [{k: jnp.asarray(w.T) for k, w in ws.items()} for ws in layers], jnp.asarray(head.T)
    fused = []
    for ws in layers:
        ws = dict(ws)
        if variant == "fused qkv, gate/up":
            ws["qkv"] = jnp.concatenate([ws.pop("q"), ws.pop("k"), ws.pop("v")], axis=0)
        if variant.startswith("fused"):
            ws["gate_up"] = jnp.concatenate([ws.pop("gate"), ws.pop("up")], axis=0)
        fused.append(ws)
    return fused, head


def make_step(variant: str, steps: int, qkv_split: tuple[int, int]):
    """A jitted function running `steps` matmul-only decode steps of `variant`.

    `qkv_split` is where the keys and the values start in a fused q/k/v output.
    """

    f32 = jnp.float32
    # The features' dimension of the activations.
    f = -1 if variant in ROW_MAJOR else 0

    def mm(x, w):
        if variant in ROW_MAJOR:
            contract = 0 if variant == "x @ w, [in,out]" else 1
            dims = (((1,), (contract,)), ((), ()))
            return jax.lax.dot_general(x.astype(w.dtype), w, dims, preferred_element_type=f32)
        if variant == "w @ x one dot":
            dims = (((1,), (0,)), ((), ()))
            return jax.lax.dot_general(w, x.astype(w.dtype), dims, preferred_element_type=f32)
        return matmul(w, x)

    def layer(x, ws):
        if "qkv" in ws:
            q, k, v = jnp.split(mm(x, ws["qkv"]), qkv_split, axis=f)
        else:
            q, k, v = mm(x, ws["q"]), mm(x, ws["k"]), mm(x, ws["v"])
        # Keys and values feed the output so that XLA keeps their matmuls.
        a = q + 1e-9 * (k.sum(f, keepdims=True) + v.sum(f, keepdims=True))
        x = x + mm(a, ws["o"])
        if "gate_up" in ws:
            gate, up = jnp.split(mm(x, ws["gate_up"]), 2, axis=f)
        else:
            gate, up = mm(x, ws["gate"]), mm(x, ws["up"])
        x = x + mm(jax.nn.silu(gate) * up, ws["down"])
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=f, keepdims=True) + 1e-5)

    def run(layers, head, x):
        def step(_, x):
            for ws in layers:
                x = layer(x, ws)
            return x + 1e-9 * mm(x, head).sum(f, keepdims=True)

        # `x` comes in and leaves row-major.
        x = jax.lax.fori_loop(0, steps, step, x if f else x.T)
        return x if f else x.T

    return jax.jit(run)


def run(
    model_path: str | None,
    rows: list[int],
    steps: int,
    rounds: int,
    variants=VARIANTS,
    dtype: str = "float32",
) -> dict:
    """Time every variant at every row count; see the module's docstring."""
    import jaxlm

    model, _ = jaxlm.load(model_path, dtype=dtype, progress=False)
    layers, head = layer_weights(model)
    q, k = layers[0]["q"].shape[0], layers[0]["k"].shape[0]
    weight_bytes = sum(w.nbytes for ws in layers for w in ws.values()) + head.nbytes
    rng = np.random.default_rng(0)
    xs = {m: jnp.asarray(rng.standard_normal((m, head.shape[1])), jnp.float32) for m in rows}
    cases, outputs = {}, {}
    for variant in variants:
        ws, h = _variant_weights(variant, layers, head)
        fn, one = make_step(variant, steps, (q, q + k)), make_step(variant, 1, (q, q + k))
        for m in rows:
            cases[(variant, m)] = (fn, ws, h, xs[m])
            # One step is compared: over many, rounding differences grow through the norms.
            outputs[(variant, m)] = np.asarray(one(ws, h, xs[m]))
    times = {key: [] for key in cases}
    with OtherLoad() as load:
        for _ in range(rounds):
            for key, (fn, ws, h, x) in cases.items():
                t = time.perf_counter()
                fn(ws, h, x).block_until_ready()
                times[key].append((time.perf_counter() - t) / steps)
    results = []
    for (variant, m), ts in times.items():
        reference = outputs[(variants[0], m)]
        results.append(
            {
                "variant": variant,
                "rows": m,
                "median_ms": 1e3 * statistics.median(ts),
                "best_ms": 1e3 * min(ts),
                "weights_gb_s": weight_bytes / statistics.median(ts) / 1e9,
                "max_abs_diff": float(np.max(np.abs(outputs[(variant, m)] - reference))),
            }
        )
    return {
        "dtype": dtype,
        "weight_bytes": weight_bytes,
        "steps": steps,
        "rounds": rounds,
        "other_load_cores": load.cores,
        "results": results,
    }


def format_table(report: dict) -> str:
    header = ("variant", "rows", "median ms/step", "best ms/step", "weights GB/s", "max diff")
    rows = [
        (
            r["variant"],
            str(r["rows"]),
            f"{r['median_ms']:.2f}",
            f"{r['best_ms']:.2f}",
            f"{r['weights_gb_s']:.1f}",
            f"{r['max_abs_diff']:.1e}",
        )
        for r in report["results"]
    ]
    lines = [
        f"matmuls of a decode step, {report['weight_bytes'] / 2**20:.1f} MiB of "
        f"{report['dtype']} weights, "
        f"{report['steps']} steps per call, medians of {report['rounds']} rounds; "
        f"load {report['other_load_cores']:.2f} (cores busy with other processes)",
        *text_table(header, rows),
        "max diff: largest difference from `w @ x`'s output after one step",
    ]
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hugging Face directory or .gguf file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--rows", type=_ints, default=[1, 8], help="activation rows, e.g. 1,8")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
    p.add_argument("--rounds", type=int, default=5, help="timed calls per variant")
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = p.parse_args(argv)
    report = run(args.model, args.rows, args.steps, args.rounds, dtype=args.dtype)
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Printing the benchmark's results as text tables."""

from __future__ import annotations


def _fmt(value, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def cell_line(r: dict) -> str:
    j = r["jaxlm"]
    return (
        f"[bench] batch {r['batch']}, prompt {r['prompt_len']}, new {r['new_tokens']}: "
        f"prefill {_fmt(j['prefill_tok_s'])} tok/s, decode {_fmt(j['decode_tok_s'])} tok/s"
    )


def text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """The lines of a right-aligned text table with a rule under `header`."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return lines


def format_report(report: dict) -> str:
    """The benchmark's results as text tables."""
    from jaxlm.memory import format_bytes

    mib = 2**20
    m, bw = report["model"], report["bandwidth"]
    lines = [
        f"model {m['path']} ({m['dtype']}, {m['parameters'] / 1e6:.3g}M parameters, "
        f"weights {format_bytes(m['weights_bytes'])}, loaded in {m['load_s']:.1f} s)",
        f"machine {report['machine']['cpu']}, {report['machine']['cores']} cores; "
        f"memory read bandwidth {bw['bytes_per_s'] / 2**30:.1f} GiB/s "
        f"(numpy {bw['numpy_bytes_per_s'] / 2**30:.1f}, XLA {bw['xla_bytes_per_s'] / 2**30:.1f}); "
        f"a decode step reading {format_bytes(m['weights_read_per_step_bytes'])} of weights "
        f"can run at most {bw['bytes_per_s'] / m['weights_read_per_step_bytes']:.1f} steps/s",
    ]
    l3 = report["machine"]["l3_bytes"]
    if l3 and m["weights_read_per_step_bytes"] <= l3:
        lines.append(
            f"note: the weights fit in the {l3 / mib:.0f} MiB L3 cache, so decode may beat the "
            "DRAM bandwidth limit"
        )
    if m["quantize"]:
        lines.append(f"quantized products: {report['machine']['products']}")
    lines.append(
        f"medians of {report['settings']['repeats']} repeats; RSS "
        f"{report['baseline_rss_bytes'] / mib:.0f} MiB before loading, "
        f"{m['rss_after_load_bytes'] / mib:.0f} MiB after (peak "
        f"{m['peak_rss_while_loading_bytes'] / mib:.0f} MiB while loading)"
    )
    lines.append("")
    header = (
        "batch",
        "prompt",
        "new",
        "prefill tok/s",
        "TTFT ms",
        "decode tok/s",
        "per row",
        "of BW",
        "compile s",
        "cached s",
        "peak RSS MiB",
        "predicted MiB",
        "load",
    )
    rows = []
    for r in report["cells"]:
        j = r["jaxlm"]
        rows.append(
            (
                str(r["batch"]),
                str(r["prompt_len"]),
                str(r["new_tokens"]),
                _fmt(j["prefill_tok_s"]),
                _fmt(j["ttft_s"], scale=1e3),
                _fmt(j["decode_tok_s"]),
                _fmt(j["decode_tok_s_per_row"]),
                _fmt(j.get("bandwidth_fraction"), ".0%"),
                _fmt(j["first_call_cold_s"], ".2f"),
                _fmt(j["first_call_cached_s"], ".2f"),
                _fmt(j["peak_rss_bytes"], ".0f", 1 / mib),
                _fmt(j["predicted_peak_bytes"], ".0f", 1 / mib),
                _fmt(r["other_load_cores"], ".2f"),
            )
        )
    lines += text_table(header, rows)
    lines.append(
        "compile s / cached s: plan + first `generate` with an empty persistent compilation "
        "cache / after `jax.clear_caches()` with it filled; of BW: decode steps/s over "
        "bandwidth / weight bytes; load: cores busy with other processes while the cell ran; "
        "peak RSS: while the cell generated"
        + (
            ""
            if all(r["jaxlm"]["peak_rss_since"] == "generation" for r in report["cells"])
            else " (here: since the start, this system cannot reset it)"
        )
        + "; predicted: RSS before loading + the plan's whole bill + its compiled steps' "
        "host memory"
    )
    if report["settings"]["vs"]:
        lines.append("peak RSS includes the other engines' copies of the weights")
    comparisons = []
    for r in report["cells"]:
        for name, ratio in r["ratios"].items():
            o = r[name]
            comparisons.append(
                (
                    name,
                    str(r["batch"]),
                    str(r["prompt_len"]),
                    str(r["new_tokens"]),
                    _fmt(o["prefill_tok_s"]),
                    _fmt(o["decode_tok_s"]),
                    _ratio(ratio["prefill_tok_s"]),
                    _ratio(ratio["decode_tok_s"]),
                    str(ratio["same_tokens"]),
                )
            )
    if comparisons:
        header = (
            "engine",
            "batch",
            "prompt",
            "new",
            "prefill tok/s",
            "decode tok/s",
            "jaxlm/it prefill",
            "jaxlm/it decode",
            "same tokens",
        )
        lines += ["", *text_table(header, comparisons)]
        lines.append(
            "ratios: the median [and each repeat's pair]; same tokens: leading greedy tokens of "
            "row 0 that agree with jaxlm"
        )
    for name, reason in report["skipped"].items():
        lines.append(f"{name}: {reason}")
    return "\n".join(lines)


def _ratio(r: dict) -> str:
    pairs = ", ".join(_fmt(p, ".2f") for p in r["pairs"])
    return f"{_fmt(r['median'], '.2f')}x [{pairs}]"

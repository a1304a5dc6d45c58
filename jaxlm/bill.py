"""The memory bill of a plan as a table, HTML and a plot: shared by `generate`'s plans
(`jaxlm.planner.Plan`) and the serving engine's (`jaxlm.batching.plan.EnginePlan`)."""

from __future__ import annotations

import html

import jax

from jaxlm.memory import ALIGNMENT, format_bytes

_HEADER = ("owner", "slot", "shape", "dtype", "bytes", "buffer")


class Bill:
    """The bill of a plan's `layout`, `executables`, `weights_bytes`, `budget` and `mesh`, and
    its reports; a plan gives their first line (`_header`) and the totals it adds to the
    common ones (`_extra_totals`)."""

    def _header(self) -> str:
        raise NotImplementedError

    def _extra_totals(self) -> list[tuple[str, str]]:
        return []

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch each device holds."""
        return self.layout.device_nbytes

    @property
    def total_bytes(self) -> int:
        """The whole bill: the peak of the most demanding step, weights and scratch included."""
        return max(e.peak for e in self.executables.values())

    @property
    def temp_bytes(self) -> int:
        """The largest XLA temporaries of the plan's steps."""
        return max(e.temp for e in self.executables.values())

    def _rows(self) -> list[tuple[str, ...]]:
        rows = []
        for slot in self.layout.slots:
            dtype = str(slot.dtype)
            if slot.dtype != slot.spec.dtype:
                dtype = f"{slot.spec.dtype} as {slot.dtype}"
            buffer = f"own buffer @0 (align {ALIGNMENT})"
            if self.mesh is not None:
                shape = ", ".join(map(str, slot.shard_shape))
                buffer = f"[{shape}] per device, {slot.sharding.spec}"
            rows.append(
                (
                    slot.owner or "-",
                    slot.name,
                    "[" + ", ".join(map(str, slot.shape)) + "]",
                    dtype,
                    format_bytes(slot.device_nbytes),
                    buffer,
                )
            )
        return rows

    def _where(self, partitioner) -> str:
        if self.mesh is None:
            return f"device={jax.devices()[0]}"
        axes = " x ".join(f"{name}={size}" for name, size in self.mesh.shape.items())
        kv = ", KV heads replicated over `model`" if partitioner.kv_heads_replicated else ""
        return f"mesh {axes} ({self.mesh.size} devices{kv}; bytes are per device)"

    def _totals(self) -> list[tuple[str, str]]:
        lines = [
            ("weights", format_bytes(self.weights_bytes)),
            (f"scratch ({len(self.layout.slots)} slots)", format_bytes(self.scratch_bytes)),
        ]
        for e in self.executables.values():
            lines.append(
                (
                    f"XLA `{e.name}`",
                    f"arguments {format_bytes(e.argument)}, outputs {format_bytes(e.output)}, "
                    f"aliased {format_bytes(e.alias)}, temporaries {format_bytes(e.temp)}, "
                    f"peak {format_bytes(e.peak)}",
                )
            )
        lines.append(("whole bill (peak)", format_bytes(self.total_bytes)))
        lines.extend(self._extra_totals())
        if self.budget is not None:
            lines.append(("budget", format_bytes(self.budget)))
        return lines

    def __str__(self) -> str:
        rows = [_HEADER, *self._rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
        lines = [self._header()]
        for i, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        lines.extend(f"{k}: {v}" for k, v in self._totals())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(f"<th>{h}</th>" for h in _HEADER)
        body = "".join(
            "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in self._rows()
        )
        totals = "".join(
            f"<tr><th style='text-align:left'>{esc(k)}</th><td>{esc(v)}</td></tr>"
            for k, v in self._totals()
        )
        return (
            f"<b>{esc(repr(self))}</b><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table><table>{totals}</table>"
        )

    def plot(self, ax=None):
        """Draw the bill as one stacked bar, against the budget where there is one: the weights,
        each scratch slot (alternate shades), then the rest of the largest step's peak (XLA's
        temporaries and the step's inputs and outputs); returns the axes."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(9, 2.2))
        mib = 2**20
        ax.barh("bill", self.weights_bytes / mib, color="tab:blue", label="weights")
        left = self.weights_bytes / mib
        cmap = plt.get_cmap("Oranges")
        for i, slot in enumerate(self.layout.slots):
            label = "scratch (slots alternate shades)" if i == 0 else None
            size = slot.device_nbytes / mib
            shade = cmap(0.35 + 0.5 * (i % 2))
            ax.barh("bill", size, left=left, color=shade, linewidth=0, label=label)
            left += size
        rest = (self.total_bytes - self.weights_bytes - self.scratch_bytes) / mib
        ax.barh("bill", rest, left=left, color="tab:green", label="XLA temporaries and inputs")
        if self.budget is not None:
            ax.axvline(self.budget / mib, color="tab:red", label="budget")
        ax.set_xlabel("MiB")
        ax.set_title(repr(self))
        ax.legend(loc="lower right", fontsize="small")
        return ax

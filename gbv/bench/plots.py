"""Matplotlib (Agg) plots of the summary rows: a metric against K, and against temperature.

One PNG per plot kind, one panel per (dataset, L, T) cell (or per (dataset, L) for the temperature
plot). Methods that draft one path (or none) have no K axis: they are drawn as horizontal lines.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gbv.atomic import atomic_path  # noqa: E402

STYLE = {  # method -> (color, marker)
    "gbv": ("#d62728", "o"),
    "gbv-adaptive": ("#e377c2", "D"),
    "traversal": ("#1f77b4", "s"),
    "specinfer": ("#2ca02c", "^"),
    "spectr": ("#9467bd", "v"),
    "block": ("#ff7f0e", None),
    "token": ("#8c564b", None),
    "hf-assisted": ("#17becf", None),
    "ar": ("#7f7f7f", None),
    "hf-ar": ("#bcbd22", None),
    "lp": ("#000000", "x"),
}
LINE_ONLY = {"block": "--", "token": ":", "hf-assisted": "-.", "ar": (0, (1, 3)), "hf-ar": (0, (3, 3))}


def _save(fig, path: Path) -> None:
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=90, bbox_inches="tight")
    finally:
        plt.close(fig)


def _grid(n_rows: int, n_cols: int):
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(3.6 * n_cols + 0.5, 2.9 * n_rows + 0.4),
                             squeeze=False)
    return fig, axes


def _group_label(group: tuple, names: tuple[str, ...]) -> str:
    return ", ".join(f"{n}={v:g}" if isinstance(v, float) else (f"{n}={v}" if n else str(v))
                     for n, v in zip(names, group) if v is not None)


def plot_vs_k(rows: list[dict], value: str, ylabel: str, path: Path, panel_keys: tuple[str, ...],
              panel_names: tuple[str, ...], multi_methods: list[str], flat_methods: list[str],
              title: str) -> None:
    """``value`` against K per multi-path method; flat methods (one K) as horizontal lines.
    Panels: one per distinct tuple of ``panel_keys`` (flat rows with L=None go to every panel of
    their other keys)."""
    panels = sorted({tuple(r[k] for k in panel_keys) for r in rows if r["method"] in multi_methods
                     or (r["method"] in flat_methods and all(r[k] is not None for k in panel_keys))},
                    key=lambda t: tuple((0, x) if x is not None else (1, 0) for x in t))
    if not panels:
        return
    n_cols = min(4, len(panels))
    n_rows = (len(panels) + n_cols - 1) // n_cols
    fig, axes = _grid(n_rows, n_cols)
    all_k = sorted({r["K"] for r in rows if r["method"] in multi_methods}) or [1]
    for idx, panel in enumerate(panels):
        ax = axes[idx // n_cols][idx % n_cols]
        match = dict(zip(panel_keys, panel))

        def in_panel(r: dict) -> bool:
            return all(r[k] == v or (r[k] is None and k == "L") for k, v in match.items())

        for method in multi_methods:
            pts = sorted((r["K"], r[value]) for r in rows if r["method"] == method and in_panel(r)
                         and r.get(value) is not None)
            if pts:
                color, marker = STYLE.get(method, (None, "o"))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker or "o", color=color,
                        label=method, linewidth=1.6 if method in ("gbv", "lp") else 1.1)
        for method in flat_methods:
            vals = [r[value] for r in rows if r["method"] == method and in_panel(r) and r.get(value) is not None]
            if vals:
                color, _ = STYLE.get(method, (None, None))
                ax.hlines(vals[0], all_k[0], all_k[-1], colors=color, linestyles=LINE_ONLY.get(method, "--"),
                          label=method)
        ax.set_title(_group_label(panel, panel_names), fontsize=9)
        ax.set_xlabel("K (draft paths)")
        ax.set_xticks(all_k)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    _hide_unused_and_add_legend(fig, axes, len(panels), n_cols, max_legend_cols=9, legend_y=1.0 + 0.06 / n_rows)
    fig.suptitle(title, y=1.0 + 0.12 / n_rows, fontsize=10)
    fig.tight_layout()
    _save(fig, path)



def _hide_unused_and_add_legend(fig, axes, used_panels: int, n_cols: int, max_legend_cols: int,
                                legend_y: float) -> None:
    """Blank the grid cells past the last panel; one figure legend with every label once (panels
    share methods, so per-axes legends would repeat them)."""
    for idx in range(used_panels, len(axes) * n_cols):
        axes[idx // n_cols][idx % n_cols].axis("off")
    handles: dict = {}
    for ax_row in axes:
        for ax in ax_row:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="upper center",
               ncol=min(len(handles), max_legend_cols), fontsize=8, bbox_to_anchor=(0.5, legend_y))

def plot_vs_temperature(rows: list[dict], value: str, ylabel: str, path: Path, panel_keys: tuple[str, ...],
                        panel_names: tuple[str, ...], methods: list[str], title: str) -> None:
    """``value`` against T; multi-path methods at their largest K in the rows, others at K = 1."""
    panels = sorted({tuple(r[k] for k in panel_keys) for r in rows
                     if all(r[k] is not None for k in panel_keys)})
    if not panels:
        return
    n_cols = min(4, len(panels))
    n_rows = (len(panels) + n_cols - 1) // n_cols
    fig, axes = _grid(n_rows, n_cols)
    k_max = max((r["K"] for r in rows), default=1)
    for idx, panel in enumerate(panels):
        ax = axes[idx // n_cols][idx % n_cols]
        match = dict(zip(panel_keys, panel))
        for method in methods:
            sel = [r for r in rows if r["method"] == method and r.get(value) is not None
                   and all(r[k] == v or (r[k] is None and k == "L") for k, v in match.items())]
            if not sel:
                continue
            k_use = max(r["K"] for r in sel)
            pts = sorted((r["T"], r[value]) for r in sel if r["K"] == k_use)
            color, marker = STYLE.get(method, (None, "o"))
            label = method if k_use == 1 else f"{method} (K={k_use})"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker or ".", color=color, label=label,
                    linestyle="-" if marker else LINE_ONLY.get(method, "--"))
        ax.set_title(_group_label(panel, panel_names), fontsize=9)
        ax.set_xlabel("temperature T")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    _hide_unused_and_add_legend(fig, axes, len(panels), n_cols, max_legend_cols=5, legend_y=1.0 + 0.1 / n_rows)
    fig.suptitle(f"{title} (multi-path methods at K={k_max})", y=1.0 + 0.2 / n_rows, fontsize=10)
    fig.tight_layout()
    _save(fig, path)

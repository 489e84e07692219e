"""search.png: best-so-far throughput (tok/s/GPU) against simulator evaluations."""

from __future__ import annotations


def plot_search_curve(path, curves: dict, megatron: float | None = None,
                      exact: float | None = None, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, curve in curves.items():
        if not curve:
            continue
        xs = [0] + [int(e) for e, _ in curve]
        ys = [0.0] + [float(v) for _, v in curve]
        ax.step(xs, ys, where="post", label=name, linewidth=1.6)
    if megatron is not None:
        ax.axhline(megatron, color="tab:gray", linestyle="--", linewidth=1.2,
                   label=f"Megatron heuristic ({megatron:.1f})")
    if exact is not None:
        ax.axhline(exact, color="black", linestyle=":", linewidth=1.2,
                   label=f"exact optimum ({exact:.1f})")
    ax.set_xlabel("simulator evaluations")
    ax.set_ylabel("best tokens/s per GPU so far")
    if title:
        ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

"""search.png: best-so-far throughput (tok/s/GPU) against simulator evaluations."""

from __future__ import annotations


def search_title(model: str, mesh: str, hardware: str, workload: dict, policy: str,
                 budget: int) -> str:
    """The title of compile's search.png: what was searched, so that a picture taken out of its
    folder still says it. ``workload`` is plan.json's (phase, batch, context / prompt in
    tokens, SLOs in ms); e.g. ``llama3_70b on 8x2 h100 | prefill, prompt 2048 tokens, TTFT
    SLO 2000 ms | search exact, budget 4000``."""
    if workload.get("phase") == "prefill":
        wl = (f"prefill, prompt {workload.get('prompt')} tokens, "
              f"TTFT SLO {workload.get('ttft_slo_ms'):g} ms")
    else:
        wl = (f"{workload.get('phase')}, context {workload.get('context')} tokens, "
              f"TPOT SLO {workload.get('tpot_slo_ms'):g} ms")
    from shardc.text import clean_text  # no control character reaches matplotlib

    return clean_text(f"{model} on {mesh} {hardware} | {wl} | search {policy}, budget {budget}",
                      400)


def plot_search_curve(path, curves: dict, megatron: float | None = None,
                      exact: float | None = None, title: str = "",
                      best_practice: float | None = None) -> str:
    """Draw and save the figure; returns the title it carries ("" if none)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # the object API, not pyplot: no backend switch, no global figure state, and ~0.3 CPU s
    # less to import on a cold compile
    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, curve in curves.items():
        if not curve:
            continue
        xs = [0] + [int(e) for e, _ in curve]
        ys = [0.0] + [float(v) for _, v in curve]
        ax.step(xs, ys, where="post", label=name, linewidth=1.6)
    if megatron is not None:
        ax.axhline(megatron, color="tab:gray", linestyle="--", linewidth=1.2,
                   label=f"Megatron heuristic ({megatron:.1f})")
    if best_practice is not None:
        ax.axhline(best_practice, color="tab:brown", linestyle="-.", linewidth=1.2,
                   label=f"best practice ({best_practice:.1f})")
    if exact is not None:
        ax.axhline(exact, color="black", linestyle=":", linewidth=1.2,
                   label=f"exact optimum ({exact:.1f})")
    ax.set_xlabel("simulator evaluations")
    ax.set_ylabel("best tokens/s per GPU so far")
    if title:
        from shardc.text import clean_text

        ax.set_title(clean_text(title, 400))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return ax.get_title()

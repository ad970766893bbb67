"""Pictures of recorded steps (tiny_zero.measure.trace), with matplotlib
(pip install -e ".[plot]"):

    timeline(traces, path, title)   ranks as rows, a compute and a comm lane
                                    each, waits in red; under them rank 0's
                                    memory over the step, on the same clock
    memory(runs, path)              memory over the step of several runs side
                                    by side, on one scale, phases marked

    python -m tiny_zero.measure.draw DIR/trace.json     # -> DIR/trace.png, and the summary line
"""
import argparse
from pathlib import Path

from .memory import CATEGORIES
from .trace import comm_lanes, of, peak, read, summary_line

PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fde2c8", "step": "#dcefd8"}
LAYER_COLORS = {"forward": "#4c78a8", "backward": "#f58518"}
KIND_COLORS = {"all_reduce": "#54a24b", "reduce_scatter": "#b279a2", "all_gather": "#4c9ed9",
               "broadcast": "#72b7b2", "reduce": "#e45756", "all_to_all": "#eeca3b"}
WAIT_COLOR = "#d62728"
CATEGORY_COLORS = {"parameters": "#4c78a8", "gradients": "#f58518", "optimizer_state": "#54a24b",
                   "comm_buffers": "#e45756", "activations": "#b279a2", "other": "#bab0ac"}
MIB = 2**20


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def ms(us):
    return us / 1e3


def mark_phases(ax, trace, label=True):
    """The phases as shaded bands, named at the top."""
    for span in of(trace, "phase"):
        ax.axvspan(ms(span["start"]), ms(span["end"]), color=PHASE_COLORS.get(span["name"], "#eeeeee"), zorder=0)
        if label:
            ax.text(ms(span["start"] + span["end"]) / 2, 1.0, span["name"], transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8, color="#555555")


def draw_lanes(ax, trace):
    """One rank: the compute lane at y 1..2 (layers, waits over them), comm lanes below 0..1."""
    for span in of(trace, "layer"):
        direction = span["name"].rsplit(" ", 1)[-1]
        ax.broken_barh([(ms(span["start"]), ms(span["end"] - span["start"]))], (1.15, 0.7),
                       color=LAYER_COLORS.get(direction, "#888888"), edgecolor="white", linewidth=0.3)
    for span in of(trace, "wait"):
        ax.broken_barh([(ms(span["start"]), ms(span["end"] - span["start"]))], (1.05, 0.9),
                       facecolor="none", edgecolor=WAIT_COLOR, hatch="////", linewidth=0.8)
    comms = of(trace, "comm")
    lanes = comm_lanes(comms)
    height = 0.8 / max(1, max(lanes, default=0) + 1)
    for span, lane in zip(comms, lanes):
        ax.broken_barh([(ms(span["start"]), ms(span["end"] - span["start"]))], (0.9 - (lane + 1) * height, height),
                       color=KIND_COLORS.get(span["name"], "#888888"), edgecolor="white", linewidth=0.3)
    ax.set_ylim(0, 2.15)
    ax.set_yticks([0.5, 1.5], ["comm", "compute"])
    ax.set_ylabel(f"rank {trace['rank']}", rotation=0, ha="right", va="center", fontsize=10)


def stack(ax, trace, scale=MIB):
    """Memory over the step, stacked by category (steps: each state lasts until the next change)."""
    times = [ms(t) for t, _ in trace["memory"]] + [ms(trace["end"])]
    for_plot = lambda values: values + values[-1:]  # noqa: E731  (the last state lasts until the end)
    ys = [for_plot([split[c] / scale for _, split in trace["memory"]]) for c in CATEGORIES]
    ax.stackplot(times, ys, labels=[c.replace("_", " ") for c in CATEGORIES], step="post",
                 colors=[CATEGORY_COLORS[c] for c in CATEGORIES], linewidth=0)
    size, t, _ = peak(trace)
    ax.plot([ms(t)], [size / scale], marker="v", color="black", markersize=6)
    late = t > trace["end"] / 2  # the label goes on the side with room
    ax.annotate(f"peak {size / scale:.1f} MiB", (ms(t), size / scale), textcoords="offset points",
                xytext=(-6 if late else 6, 2), ha="right" if late else "left", fontsize=8)


def legend_items(plt, kinds):
    patches = [plt.Rectangle((0, 0), 1, 1, color=LAYER_COLORS[d], label=f"layer {d}") for d in LAYER_COLORS]
    patches += [plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor=WAIT_COLOR, hatch="////", label="wait")]
    patches += [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS.get(k, "#888888"), label=k) for k in kinds]
    return patches


def timeline(traces, path, title=""):
    plt = pyplot()
    fig, axes = plt.subplots(len(traces) + 1, 1, sharex=True, figsize=(13, 1.5 * len(traces) + 2.6),
                             gridspec_kw={"height_ratios": [1.2] * len(traces) + [2.2]})
    for ax, trace in zip(axes, traces):
        mark_phases(ax, trace, label=ax is axes[0])
        draw_lanes(ax, trace)
    kinds = sorted({s["name"] for t in traces for s in of(t, "comm")})
    axes[0].legend(handles=legend_items(plt, kinds), loc="lower left", bbox_to_anchor=(0, 1.12),
                   ncol=len(kinds) + 3, fontsize=8, frameon=False)
    memory_ax = axes[-1]
    mark_phases(memory_ax, traces[0], label=False)
    stack(memory_ax, traces[0])
    memory_ax.set_ylabel("rank 0\nMiB live", fontsize=9)
    memory_ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=7, frameon=False)
    memory_ax.set_xlabel("ms from the start of the step")
    fig.suptitle(title, y=0.995, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory(runs, path):
    """runs: [(name, traces)]: rank 0 of each, side by side on one scale."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(runs), sharey=True, figsize=(3.1 * len(runs), 3.6), squeeze=False)
    for ax, (name, traces) in zip(axes[0], runs):
        mark_phases(ax, traces[0])
        stack(ax, traces[0])
        ax.set_title(name, pad=14)
        ax.set_xlabel("ms")
    axes[0][0].set_ylabel("MiB live on rank 0")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="Draw a step that --trace recorded, and print what it says.")
    p.add_argument("trace", help="a trace.json written by --trace (tiny_zero.measure.trace)")
    p.add_argument("--out", default=None, help="the PNG to write (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    traces, title = read(args.trace)
    out = args.out or str(Path(args.trace).with_suffix(".png"))
    timeline(traces, out, title)
    print(summary_line(title or "trace", traces))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

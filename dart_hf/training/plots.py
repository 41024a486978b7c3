"""The curves of a training run, as one PNG beside the head (`training_curves.png`)."""

from __future__ import annotations

from pathlib import Path


def plot_history(history: list[dict], path: Path, evaluations: list[dict] | None = None) -> None:
    """Loss and per-depth top-1 accuracy against training sequences, and (when measured) mean accepted
    length on held-out prompts against response tokens trained on, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    seqs = [h["sequences"] for h in history]
    panels = 3 if evaluations else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    ax_loss, ax_acc = axes[0], axes[1]
    ax_loss.plot(seqs, [h["loss"] for h in history])
    ax_loss.set(xlabel="training sequences", ylabel="depth-weighted loss (KL or CE)", title="loss")
    for d in range(len(history[0]["accuracy"])):
        ax_acc.plot(seqs, [h["accuracy"][d] for h in history], label=f"depth {d}")
    ax_acc.set(xlabel="training sequences", ylabel="top-1 accuracy vs target", title="per-depth accuracy")
    ax_acc.legend(fontsize=7, ncol=2)
    if evaluations:
        ax_len = axes[2]
        for name in evaluations[0]["accepted_length"]:
            ax_len.plot([e["tokens"] for e in evaluations], [e["accepted_length"][name] for e in evaluations],
                        marker="o", label=name)
        ax_len.set(xlabel="response tokens trained on", ylabel="mean accepted length (greedy)",
                   title="held-out accepted length")
        ax_len.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Link prediction's model selection (sven.tasks.link.improved)."""

from __future__ import annotations


def test_select_rules_pick_different_epochs_on_one_history() -> None:
    from sven.tasks.link import improved

    # Val AP creeps up to the last epoch while val AUC peaks at epoch 1 (JODIE's shape).
    history = [(0.80, 0.85), (0.82, 0.88), (0.83, 0.87), (0.84, 0.86)]

    def kept(select: str) -> list[int]:
        best: dict[str, float] = {"best_val_ap": -1.0, "best_val_auc": -1.0}
        out = []
        for epoch, (ap, auc) in enumerate(history):
            if improved(select, {"val_ap": ap, "val_auc": auc}, best):
                best.update(best_val_ap=ap, best_val_auc=auc)
                out.append(epoch)
        return out

    assert kept("ap") == [0, 1, 2, 3]
    assert kept("ap_auc") == [0, 1]
    # Ties count as improvement under ap_auc (DyGLib's >=), not under ap; NaN never does.
    tie = {"best_val_ap": 0.8, "best_val_auc": 0.8}
    assert improved("ap_auc", {"val_ap": 0.8, "val_auc": 0.8}, tie)
    assert not improved("ap", {"val_ap": 0.8, "val_auc": 0.9}, tie)
    assert not improved("ap_auc", {"val_ap": 0.9, "val_auc": float("nan")}, tie)
    # A checkpoint from before best_val_auc existed resumes under ap_auc.
    assert improved("ap_auc", {"val_ap": 0.9, "val_auc": 0.1}, {"best_val_ap": 0.8})

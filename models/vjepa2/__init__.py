"""V-JEPA 2 (video encoder + masked predictor) and V-JEPA 2-AC (action-conditioned predictor,
rollouts on a per-sample K/V cache, CEM planning)."""

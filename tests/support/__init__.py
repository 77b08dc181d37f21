"""What tests attach to paratrain through its hooks (src/paratrain/train/hooks.py, docs/hooks.md): planted bugs
(faults.py), a slowed rank (throttle.py), a slow loader (loader_delay.py), a wrong planner (prediction_scale.py),
a rank that stalls or dies at a chosen point (hang_points.py), a rank that burns CPU in one phase (slow_phase.py).

In-process: plant(...)/attach(...) on a registry. In a subprocess (`paratrain ...`) and its workers: name a
module's `plugin` in PARATRAIN_PLUGINS and its setting in its PARATRAIN_TEST_* variable; helpers.plugin_env()
builds that environment (it puts tests/ on PYTHONPATH so `support` imports)."""

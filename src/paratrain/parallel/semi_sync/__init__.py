"""Semi-synchronous training (--semi-sync diloco | streaming-diloco): islands, the replicated data-parallel groups
(--dp-replicate), each train on their own with any inner layout and meet every --sync-every steps for an outer
optimizer step on their averaged parameter change. One file per job: semi_sync_options.py (the config fields),
islands.py (what it can run; the Layout keeps data parallelism inside each island), fragments.py (which parameters
sync when), outer_codec.py (the outer all-reduce in fp32, bf16, int8 or int4), outer_sync.py (the global copy and
the outer step), checkpoint_state.py (what a checkpoint holds of them). Importing this package imports no torch."""

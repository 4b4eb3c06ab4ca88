"""Engine adapters (installed as ``scd_store.adapters``): the transformers runner (the embedded
default engine), and later the LMCache storage plugin and the SGLang HiCache backend."""

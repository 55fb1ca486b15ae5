"""Hugging Face interop, one module per job (imported from there: this package imports nothing).

* `config`   HF `config.json` <-> our `ModelConfig` (read_hf_config, config_from_hf, config_to_hf)
* `names`    tensor-name mapping, expected shapes, and the one name/shape validator `validate`
             (plus the in-memory state-dict converters built on it)
* `load`     sharded loading: each rank reads only its own slices of the HF safetensors
* `export`   one of our DCP checkpoints -> an HF model folder or a peft adapter (offline, bounded memory)
* `import_`  an HF model folder -> a model-only DCP checkpoint (offline, one tensor at a time)

Plain PyTorch, safetensors and the standard library: no `transformers` import.
"""

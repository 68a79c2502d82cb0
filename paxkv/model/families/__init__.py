"""Model families: one module each, listed by checkpoint architecture in `../registry.py`.

A family module declares, and nothing else needs to know:

- `ARCHITECTURE`, `MODEL_TYPE`: the names its checkpoints' config.json uses;
- `config_from_hf(raw, name) -> ModelConfig`: its config.json parsed (a ValueError names a
  field whose value paxkv does not model);
- `tensor_specs(cfg) -> list[TensorSpec]`: every checkpoint tensor, its HF name and its
  place in the parameter tree (the fused serving layout, `fusion.py`, and the
  tensor-parallel placement, `parallel/sharding.py`, follow from the tree's names);
- `hf_config(cfg, dtype) -> dict`: a config.json transformers loads (`save_checkpoint`);
- `decoder_layer() -> type`: its Flax layer class, built from the pieces in `../layers.py`.

Adding a dense family is one module here and one line in the registry.
"""

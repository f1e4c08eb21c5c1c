"""Hugging Face checkpoints in and out (`python -m pwtrain.convert`, docs/models.md).

names.py            the one table of parameter names and layouts both directions read
hf_config.py        a Hugging Face config.json <-> pwtrain's model.* keys
hf_defaults.py      transformers' default of each key a config.json may leave out, per architecture
safetensors_io.py   safetensors files read and written one tensor at a time
tokenizer_files.py  the tokenizer's files, checked against the model and carried along
importer.py         from_hf: a checkpoint -> a run at step 0 (config, tokenizer, checkpoint)
exporter.py         to_hf: a run's checkpoint -> a directory transformers loads
"""

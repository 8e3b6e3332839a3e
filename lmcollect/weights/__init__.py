"""Weights as named tensors, in pure torch (the bottom layer: it imports nothing else of lmcollect).

``tensors``: extracting ``name -> tensor`` from a model or state dict, checking names, shapes and
dtypes against what a receiver holds, and loading into a module; ``buckets``: packing tensors into
a few flat buffers and back; ``delta``: encoding a push as the change from a held base;
``version``: the version a push carries; ``push_config``: how every updater pushes; ``lora``: LoRA adapters as a push and their checks;
``kept_base``: the base weights an engine keeps under its LoRA merges; ``cost_model``: what a push
costs over a link, and when a delta pays.
"""

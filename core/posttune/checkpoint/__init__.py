"""The Hugging Face checkpoint format: config.json + (sharded) safetensors, both ways.

    source.py          local directory or hub id; config.json; which family reads it (no torch)
    safetensors_io.py  the file format, streamed one tensor at a time
    materialize.py     build on meta, allocate once, keep tied weights tied
    hf_load.py         checkpoint -> native model (checked from headers before allocating); a
                       quantized one's tensors rebuilt by the plugin of its quant_method
    hf_save.py         native model -> checkpoint transformers loads
    convert.py         what a converter answers (one, several, or a part of a joined tensor), streamed
    keymap.py          name maps from two tables; hf_decoder.py: Llama's names and config.json fields
    atomic.py          write a directory so a crash never leaves half of one
    origin.py          what a model remembers (family, build kwargs, source config) for saving

The package exports nothing itself: callers import the module they need, so that importing it (as
`posttune plan` does) never imports torch.
"""

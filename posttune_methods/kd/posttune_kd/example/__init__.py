"""The CPU example's teacher: ``python -m posttune_kd.example prepare-teacher``.

The tiny teacher of ``posttune train kd-tiny-reverse`` is posttune-llama's demo shape (hidden
128, 4 layers, the demo's 384-token tokenizer) trained with ``train_briefly`` on the demo's
string-reversal chats until it reverses most strings; the student is a smaller random Llama
(hidden 64, 2 layers) that learns from the teacher's distributions alone.
"""

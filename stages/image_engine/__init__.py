"""The image-generation stage's engine: a diffusers text-to-image pipeline
on torch (checkpoint.py: the models it loads, a tiny built-in one
included; engine.py: drawing; stage.py: the stage a worker runs)."""

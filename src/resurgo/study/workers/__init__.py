"""Workers that run the study's experiments in another framework's own environment.

Each runs as a script with that environment's Python, which has neither torch nor resurgo:
``python driver.py FRAMEWORK CONFIG.json OUT.json``. ``driver`` (standard library only) owns the
experiments and the JSON it writes; ``<framework>_worker`` modules (standard library, numpy and
that framework only) own the network, the training step and the checkpoint calls, written as that
framework's users write them. ``resurgo.study.frameworks`` creates the environments and reads the
JSON back.
"""

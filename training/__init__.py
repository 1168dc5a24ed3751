"""The elastic training program, and the image built from this folder.

At the top, the programs the deployment runs and what wires the rooms together: ``agent``
(``python -m training.agent``, a worker pod's entry), ``launcher`` (torchrun's agent with warm
workers) and ``train`` (``python -m training.train``, one worker). The rooms: ``elastic``
(membership), ``checkpoints`` (checkpoints and their stores), ``data`` and ``loop`` (a worker's
training). Rooms never import the top.
"""

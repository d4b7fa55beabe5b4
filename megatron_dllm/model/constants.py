"""Constants of the DiT and of its noise schedule that no preset changes (as in the paper's code).

The megatron model, the noise schedule and the FLOPs formulas read them here. An HF export writes
them into config.json (`hf/export.py`), from where the self-contained modeling file reads them, and
ships this file for its samplers' noise schedule (`hf/remote_code.py`): it imports nothing.
"""

COND_DIM = 128  # width of the time-conditioning vector c
TIME_FREQ_DIM = 256  # sinusoidal features of sigma fed to the time embedder
TIME_MAX_PERIOD = 10000.0  # longest period of those sinusoids
ROTARY_BASE = 10000.0
LAYER_NORM_EPS = 1e-5
T_EPS = 1e-3  # smallest diffusion time: t in [T_EPS, 1]; the log-linear schedule's eps

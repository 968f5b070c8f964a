"""The study: the founding paper's evaluation (cost, formats and sizes, scale, determinism of
checkpointing) as a command anyone can run, ``resurgo study``, comparing torch.save, PyTorch DCP,
safetensors and resurgo.

Modules: ``models`` (CIFAR-10 ResNet-50 and VGG-16), ``data`` (synthetic or real CIFAR-10),
``training`` (the job and its loop), ``mechanisms`` (one class per way of checkpointing),
``ranks`` (spawned gloo ranks), ``experiments`` (the four experiments), ``report`` (report.md,
PNG plots, results.json). From Python::

    from resurgo.study import quick_config, run_study, write_outputs
    results = run_study(quick_config(), out)   # a JSON-ready dict
    write_outputs(results, out)                # results.json, the plots, report.md
"""

from resurgo.study.experiments import StudyConfig, full_config, quick_config, run_study, with_steps
from resurgo.study.mechanisms import MECHANISMS
from resurgo.study.report import write_outputs

__all__ = ["StudyConfig", "full_config", "quick_config", "run_study", "with_steps", "write_outputs", "MECHANISMS"]

"""The ``jaxpar`` commands, one module each: ``train``, ``check``, ``inspect``, ``plan``, ``profile``, ``export``,
``sample`` and ``data``. Each reads a config (:mod:`jaxpar.config`), builds the job, and runs, compiles or plans it;
the planner's reports are :mod:`jaxpar.plan`'s. :mod:`jaxpar.cli` parses the arguments and calls them.

No command imports another: what several share lives beside them, in ``_common`` (the job on the processes'
devices, the files a config reads, the steps to show or trace), ``_job_devices`` (the devices of a job, what a
target refuses, the compile for it), ``_lines`` (the lines printed about a job) and ``_planner_options``.
"""
from jaxpar.commands._check_command import check_config, run_check
from jaxpar.commands._data_command import run_prepare, run_show
from jaxpar.commands._inspect_command import inspect_config
from jaxpar.commands._plan_command import run_plan
from jaxpar.commands._profile_command import run_profile
from jaxpar.commands._train_command import run_train
from jaxpar.commands._weights_commands import run_export, run_sample

__all__ = ["check_config", "run_check", "run_prepare", "run_show", "run_export", "inspect_config", "run_plan",
           "run_profile", "run_sample", "run_train"]

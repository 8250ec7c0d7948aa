"""The devices a job runs on: real GPU / TPU compile targets without the hardware, the many-host
start-up (``jax.distributed``), and the measurements that calibrate the cost model's clusters
(``jaxpar calibrate [--device]``).

>>> from jaxpar.devices import parse_target
>>> parse_target("h100:1x8").spec.name
'h100'
"""
from jaxpar.devices._calibrate import calibrate as calibrate
from jaxpar.devices._device_rates import calibrate_device as calibrate_device
from jaxpar.devices._distributed import (ClusterInfo as ClusterInfo, DistributedError as DistributedError,
                                         initialize as initialize, resolve as resolve, setup_devices as setup_devices,
                                         split_devices as split_devices, start_processes as start_processes)
from jaxpar.devices._targets import (DeviceSpec as DeviceSpec, Target as Target, TargetError as TargetError,
                                     compile_error as compile_error, gpu_target_config as gpu_target_config,
                                     install_command as install_command, load_spec as load_spec,
                                     parse_target as parse_target, presets as presets, target_devices as target_devices,
                                     target_requirements as target_requirements, targets_dir as targets_dir)

__all__ = ["calibrate", "calibrate_device", "DeviceSpec", "Target", "TargetError", "compile_error", "gpu_target_config",
           "install_command", "load_spec", "parse_target", "presets", "target_devices", "target_requirements",
           "targets_dir", "ClusterInfo", "DistributedError", "initialize", "resolve", "setup_devices", "split_devices",
           "start_processes"]

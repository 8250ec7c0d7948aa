"""Hugging Face checkpoints in and out: Llama-3, Qwen3, Qwen3-MoE and Gemma-3 text models.

- :func:`open_checkpoint` reads a checkpoint directory's ``config.json`` (either dialect) into a
  :class:`~jaxpar.models.DecoderConfig` and checks its tensors; :meth:`Checkpoint.load` reads each
  device's shard straight from the safetensors files into any layout.
- :func:`train_state` starts training from a checkpoint (:func:`load`: its weights in a layout).
- :func:`export` writes parameters of any layout back, one tensor at a time.
- :func:`load_tokenizer` loads the checkpoint's ``tokenizer.json``.
"""
from jaxpar.hf._reader import Checkpoint, HFCheckpointError, load, open_checkpoint, train_state
from jaxpar.hf._config import FAMILIES, HFConfigError, decoder_config, hf_config_dict, read_config
from jaxpar.hf._export import HFExportError, export
from jaxpar.hf._files import CheckpointFiles, HFFilesError, write_safetensors
from jaxpar.hf._keys import EXPERT_LAYOUTS, TensorMap, tensor_maps
from jaxpar.data._tokenizers import Tokenizer, load_tokenizer

__all__ = ["Checkpoint", "HFCheckpointError", "open_checkpoint", "FAMILIES", "HFConfigError", "decoder_config",
           "hf_config_dict", "read_config", "HFExportError", "export", "CheckpointFiles", "HFFilesError",
           "write_safetensors", "EXPERT_LAYOUTS", "TensorMap", "tensor_maps", "Tokenizer",
           "load_tokenizer", "load", "train_state"]

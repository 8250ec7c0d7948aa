"""How jaxpar reads a user's Flax NNX model: its layers (``blocks``, ``layer_lists``), the mesh axes its
own annotations name (``mesh_axes``), its shapes, the metrics its loss reports and scoped options."""

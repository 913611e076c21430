"""export layer of gpumon (see DESIGN: layering)."""

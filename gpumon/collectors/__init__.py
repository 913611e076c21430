"""collectors layer of gpumon (see DESIGN: layering)."""

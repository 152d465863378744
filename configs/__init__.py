"""jaxdist's recipes: YAML configs that `jaxdist train NAME` loads by name. Shipped inside the wheel as
the package `jaxdist.configs` (pyproject.toml maps it to this folder), so a recipe is one file
whether jaxdist runs from a clone or from an install."""

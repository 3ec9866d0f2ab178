"""The model layer: the common model form (layers, parameters, optimizer slots), optax states
as a format-neutral ``OptState``, and the original systems' update rules as optax transformations."""

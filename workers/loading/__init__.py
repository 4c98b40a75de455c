"""Model loading: local and Hub directories, weights, the built-in tiny model, memory plans."""

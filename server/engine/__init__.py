"""The engine and its process: the worker loop's owner, the engine process, and the API process's link to it."""

"""The server: a gRPC service over an engine that batches the steps of every open turn through the served
layers, and stores each session encrypted."""

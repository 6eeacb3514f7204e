"""The tasks Parallax trains on, as prompt records with their images (`python -m tasks`): the synthetic
visual tasks and Geometry3k preprocessing, and how a record is rendered into a chat prompt."""

"""The demo's model and tasks (TinyStories-260K), as tests use them: they live with `driver demo` (driver.demo)."""

from driver.demo import DATA, MODEL, ROOT, TASKS, write_story_tasks

__all__ = ["DATA", "MODEL", "ROOT", "TASKS", "write_story_tasks"]

"""The serving controller: one service owning every host's warm-runtime pool (issue #20)."""

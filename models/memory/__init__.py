"""Where weights live: huge-page arenas, mapped checkpoint pages, the zero-page pool."""

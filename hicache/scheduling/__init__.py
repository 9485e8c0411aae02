"""The scheduler (which waiting request runs next) and the cache-aware router."""

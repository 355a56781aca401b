import threading
import time


class TokenBucket:
    """Allows `rate` requests per second on average, with bursts of up to `capacity`."""

    def __init__(self, rate, capacity, clock=time.monotonic):
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be positive")
        self.rate = rate
        self.capacity = capacity
        self.clock = clock
        self.tokens = capacity
        self.updated = clock()
        self.lock = threading.Lock()

    def _refill(self):
        now = self.clock()
        elapsed = now - self.updated
        self.tokens = self.tokens + elapsed * self.rate
        self.updated = now

    def try_acquire(self, cost=1):
        with self.lock:
            self._refill()
            if self.tokens >= cost:
                self.tokens -= cost
                return True
            return False

    def wait_time(self, cost=1):
        with self.lock:
            self._refill()
            missing = cost - self.tokens
            return max(0.0, missing / self.rate)


class PerKeyLimiter:
    def __init__(self, rate, capacity):
        self.rate = rate
        self.capacity = capacity
        self.buckets = {}

    def allow(self, key, cost=1):
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = TokenBucket(self.rate, self.capacity)
        return bucket.try_acquire(cost)

    def forget_idle(self, max_idle):
        now = time.monotonic()
        idle = [k for k, b in self.buckets.items() if now - b.updated > max_idle]
        for key in idle:
            del self.buckets[key]
        return len(idle)

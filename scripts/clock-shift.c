/*
 * clock-shift.so: an LD_PRELOAD library that moves the wall clock (CLOCK_REALTIME) of a process
 * by a fixed number of seconds, BACKLOT_CLOCK_OFFSET (may be negative), and leaves every other
 * clock alone. scripts/clock-sweep.sh builds it (cc) and runs pytest, the Celery workers and
 * beats it spawns, and a redis-server under it: all see one shifted clock, ticking forward.
 *
 * Why not libfaketime (Debian's faketime 0.9.10): under it CPython 3.11's time.sleep fails with
 * EINVAL when the monotonic clock is left real (clock_nanosleep on an absolute CLOCK_MONOTONIC
 * deadline is shifted anyway, libfaketime #426), and lock waits hang when it is faked (glibc's
 * sem_clockwait is not intercepted); redis-server (linked with jemalloc) does not start under
 * it at all ("unexpected recursive calls to clock_gettime()"; also with the copy PyPI's
 * libfaketime 3.0.1 ships). This library does much less: it asks the kernel for the time with
 * syscall(2) (no allocation, no lazy lookup, so an allocator may call it during its own start),
 * adds the offset to the realtime clocks, and takes it off again from an absolute realtime sleep
 * or semaphore deadline. Monotonic time, relative timeouts and file times stay real.
 *
 * Not shifted: absolute CLOCK_REALTIME deadlines of pthread_cond_timedwait and timers (CPython
 * waits on CLOCK_MONOTONIC; Redis has no such wait), and file modification times.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <semaphore.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long offset_s;
static int offset_read;

static long long offset(void) {
    if (!offset_read) {
        /* getenv and strtoll allocate nothing: safe this early */
        const char *value = getenv("BACKLOT_CLOCK_OFFSET");
        offset_s = value ? strtoll(value, NULL, 10) : 0;
        offset_read = 1;
    }
    return offset_s;
}

static int is_wall(clockid_t clock) {
    return clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE ||
           clock == CLOCK_REALTIME_ALARM || clock == CLOCK_TAI;
}

static int real_clock_gettime(clockid_t clock, struct timespec *ts) {
    return (int)syscall(SYS_clock_gettime, clock, ts);
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    int rc = real_clock_gettime(clock, ts);
    if (rc == 0 && is_wall(clock)) ts->tv_sec += offset();
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec now;
    (void)tz; /* obsolete: glibc no longer fills it in */
    if (real_clock_gettime(CLOCK_REALTIME, &now) != 0) return -1;
    tv->tv_sec = now.tv_sec + offset();
    tv->tv_usec = now.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *out) {
    struct timespec now;
    if (real_clock_gettime(CLOCK_REALTIME, &now) != 0) return (time_t)-1;
    now.tv_sec += offset();
    if (out != NULL) *out = now.tv_sec;
    return now.tv_sec;
}

int timespec_get(struct timespec *ts, int base) {
    if (base != TIME_UTC || clock_gettime(CLOCK_REALTIME, ts) != 0) return 0;
    return base;
}

int clock_nanosleep(clockid_t clock, int flags, const struct timespec *request,
                    struct timespec *remain) {
    struct timespec real = *request;
    if ((flags & TIMER_ABSTIME) && is_wall(clock)) real.tv_sec -= offset();
    /* returns the error number, not -1 (clock_nanosleep(2)) */
    return syscall(SYS_clock_nanosleep, clock, flags, &real, remain) == 0 ? 0 : errno;
}

int sem_timedwait(sem_t *restrict sem, const struct timespec *restrict deadline) {
    typedef int (*wait_fn)(sem_t *, const struct timespec *);
    static wait_fn next;
    struct timespec real = *deadline;
    if (next == NULL) next = (wait_fn)dlsym(RTLD_NEXT, "sem_timedwait");
    if (next == NULL) {
        errno = ENOSYS;
        return -1;
    }
    real.tv_sec -= offset();
    return next(sem, &real);
}

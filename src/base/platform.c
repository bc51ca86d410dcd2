/* platform.c - Linux calls and their POSIX fallbacks (platform.h). */
#include "base/platform.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__linux__) && !defined(TANDEM_PORTABLE)
#define PLAT_LINUX 1
#include <limits.h>
#include <linux/futex.h>
#include <sys/random.h>
#include <sys/syscall.h>
#else
#define PLAT_LINUX 0
#if defined(__APPLE__)
#include <sys/random.h>   /* getentropy */
#endif
#endif

const char *plat_name(void) { return PLAT_LINUX ? "linux" : "posix"; }

/* ==== Random bytes ==== */

#if PLAT_LINUX
int plat_random(void *buf, size_t n, int nonblock) {
    uint8_t *p = buf;
    while (n) {
        ssize_t r = getrandom(p, n, nonblock ? GRND_NONBLOCK : 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}
#else
/* getentropy gives at most 256 bytes a call (POSIX.1-2024; macOS 10.12,
 * glibc 2.25, the BSDs). It does not block once the pool is seeded, which
 * on these systems happens before user space runs, so nonblock changes
 * nothing. */
#define PLAT_ENTROPY_MAX 256
int plat_random(void *buf, size_t n, int nonblock) {
    (void)nonblock;
    uint8_t *p = buf;
    while (n) {
        size_t k = n < PLAT_ENTROPY_MAX ? n : PLAT_ENTROPY_MAX;
        if (getentropy(p, k)) return -1;
        p += k;
        n -= k;
    }
    return 0;
}
#endif

/* ==== Waiting on a word ==== */

#if PLAT_LINUX
void plat_wait(_Atomic uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

void plat_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
#else
/* Waiters sleep on a condition variable chosen by the word's address.
 * A waiter checks the word and starts waiting under the bucket's mutex,
 * and a waker takes that mutex after changing the word, so a wake between
 * the check and the wait cannot be lost. Words sharing a bucket only wake
 * each other spuriously. PLAT_BUCKETS: a thread pool has two words, a
 * process a handful of pools. */
#define PLAT_BUCKETS 64
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
} plat_bucket[PLAT_BUCKETS];
static pthread_once_t plat_once = PTHREAD_ONCE_INIT;

static void plat_buckets_init(void) {
    for (int i = 0; i < PLAT_BUCKETS; i++) {
        pthread_mutex_init(&plat_bucket[i].mu, NULL);
        pthread_cond_init(&plat_bucket[i].cv, NULL);
    }
}

static unsigned plat_bucket_of(const void *word) {
    uintptr_t a = (uintptr_t)word;
    return (unsigned)((a >> 2 ^ a >> 8) % PLAT_BUCKETS);
}

void plat_wait(_Atomic uint32_t *word, uint32_t expected) {
    pthread_once(&plat_once, plat_buckets_init);
    unsigned b = plat_bucket_of(word);
    pthread_mutex_lock(&plat_bucket[b].mu);
    if (atomic_load(word) == expected) pthread_cond_wait(&plat_bucket[b].cv, &plat_bucket[b].mu);
    pthread_mutex_unlock(&plat_bucket[b].mu);
}

void plat_wake(_Atomic uint32_t *word) {
    pthread_once(&plat_once, plat_buckets_init);
    unsigned b = plat_bucket_of(word);
    pthread_mutex_lock(&plat_bucket[b].mu);
    pthread_cond_broadcast(&plat_bucket[b].cv);
    pthread_mutex_unlock(&plat_bucket[b].mu);
}
#endif

/* ==== Sockets ==== */

#if PLAT_LINUX
int plat_socket(int family, int type, int proto, int nonblock) {
    return socket(family, type | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), proto);
}

int plat_accept(int lfd, int nonblock) {
    return accept4(lfd, NULL, NULL, SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0));
}
#else
/* The flags set after the call: another thread's fork + exec between the
 * two could inherit the descriptor (tandem execs nothing while serving). */
static int plat_fd_flags(int fd, int nonblock) {
    int fl;
    if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) return -1;
    if (nonblock && ((fl = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)) return -1;
#ifdef SO_NOSIGPIPE
    int one = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one) < 0) return -1;
#endif
    return 0;
}

static int plat_fd_finish(int fd, int nonblock) {
    if (fd < 0) return -1;
    if (plat_fd_flags(fd, nonblock)) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

int plat_socket(int family, int type, int proto, int nonblock) {
    return plat_fd_finish(socket(family, type, proto), nonblock);
}

int plat_accept(int lfd, int nonblock) {
    return plat_fd_finish(accept(lfd, NULL, NULL), nonblock);
}
#endif

/* ==== Memory ==== */

uint64_t plat_mem_available(void) {
#if PLAT_LINUX
    long long kb = 0;
    char line[256];
    FILE *f = fopen("/proc/meminfo", "r");
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) break;
    if (f) fclose(f);
    return kb > 0 ? (uint64_t)kb * 1024 : 0;
#elif defined(_SC_AVPHYS_PAGES)
    long pages = sysconf(_SC_AVPHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    return pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size : 0;
#else
    return 0;
#endif
}

void plat_file_advise(int fd, int advice) {
#if defined(POSIX_FADV_WILLNEED) && defined(POSIX_FADV_DONTNEED)
    (void)posix_fadvise(fd, 0, 0, advice == PLAT_FILE_WILLNEED ? POSIX_FADV_WILLNEED : POSIX_FADV_DONTNEED);
#else
    (void)fd;
    (void)advice;
#endif
}

void plat_map_drop(const void *p, size_t n) {
#if defined(MADV_DONTNEED)
    long pg = sysconf(_SC_PAGESIZE);
    if (pg <= 0 || !p) return;
    uintptr_t lo = ((uintptr_t)p + (uintptr_t)pg - 1) & ~((uintptr_t)pg - 1);
    uintptr_t hi = ((uintptr_t)p + n) & ~((uintptr_t)pg - 1);
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
#else
    (void)p;
    (void)n;
#endif
}

/* platform.h - the few system calls that differ between Linux and the
 * other POSIX systems a node runs on (macOS: the first user's decode nodes
 * are Mac Studios).
 *
 * On Linux each is the Linux call (futex, getrandom, accept4, the socket
 * type flags, /proc/meminfo). Elsewhere, and on Linux too when built with
 * -DTANDEM_PORTABLE (`make PORTABLE=1`, which the suite builds and runs so
 * that the fallbacks are tested on this machine), plain POSIX: a mutex with
 * condition variables, getentropy, fcntl, sysconf. */
#ifndef TANDEM_PLATFORM_H
#define TANDEM_PLATFORM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

/* "linux", or "posix" for the fallbacks (tests check which they built). */
const char *plat_name(void);

/* n random bytes from the system's generator. 0, or -1 with errno set (no
 * generator: a seccomp filter, or before the pool is seeded with
 * nonblock). */
int plat_random(void *buf, size_t n, int nonblock);

/* Sleeps while *word == expected; may return early (spuriously), so
 * callers loop on their condition. plat_wake wakes every waiter of word;
 * the writer changes *word first. */
void plat_wait(_Atomic uint32_t *word, uint32_t expected);
void plat_wake(_Atomic uint32_t *word);

/* A socket, an accepted connection: close-on-exec, non-blocking if asked,
 * and (where the system has no MSG_NOSIGNAL) no SIGPIPE from writes.
 * fd, or -1 with errno set. */
int plat_socket(int family, int type, int proto, int nonblock);
int plat_accept(int lfd, int nonblock);

/* send() flags that keep a write to a closed peer from raising SIGPIPE:
 * 0 where plat_socket sets SO_NOSIGPIPE instead (macOS, the BSDs; Linux
 * has no such option, so its portable build keeps MSG_NOSIGNAL). */
#if defined(SO_NOSIGPIPE) || !defined(MSG_NOSIGNAL)
#define PLAT_MSG_NOSIGNAL 0
#else
#define PLAT_MSG_NOSIGNAL MSG_NOSIGNAL
#endif

/* Memory a new allocation can have without swapping, in bytes: Linux's
 * MemAvailable, else the free pages sysconf reports; 0 if unknown. */
uint64_t plat_mem_available(void);

/* Advice on a whole file's pages, never an error: PLAT_FILE_WILLNEED starts
 * reading them in (asynchronous), PLAT_FILE_DONTNEED drops the clean ones
 * from the page cache. posix_fadvise where the system has it; macOS has
 * none, and there nothing is done (a hint lost, not a wrong answer). */
enum { PLAT_FILE_WILLNEED, PLAT_FILE_DONTNEED };
void plat_file_advise(int fd, int advice);

/* The whole pages of [p, p + n) leave this process's resident set, never an
 * error. Only for a read-only file mapping (MAP_PRIVATE, never written):
 * a later read faults the page back from the file (or the page cache), so
 * nothing is lost. On anonymous or written memory the contents would be:
 * never call it there. madvise(MADV_DONTNEED) where the system has it. */
void plat_map_drop(const void *p, size_t n);

#endif

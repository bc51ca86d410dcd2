/* proc.h - helpers for tests that drive real tandem processes over loopback:
 * spawning and stopping servers, /proc readings (fds, RSS), plain HTTP/1.1
 * over sockets (chunked bodies decoded), and the decode node's JSON shapes.
 * Header-only; every function is static and may go unused in a test. */
#ifndef TANDEM_TEST_PROC_H
#define TANDEM_TEST_PROC_H

#include "t.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "base/platform.h"
#include "net/node_auth.h"

#define PROC_FN static __attribute__((unused))

/* ==== Processes ==== */

PROC_FN const char *bin(void) {
    const char *b = getenv("TANDEM_BIN");
    return b && *b ? b : "build/tandem";
}

PROC_FN int asan(void) {
    const char *a = getenv("TANDEM_ASAN");
    return a && *a && strcmp(a, "0");
}

PROC_FN double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* The whole span, even when a signal (a child's SIGCHLD) interrupts it. */
PROC_FN void sleep_ms(int ms) {
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) && errno == EINTR) {}
}

/* Starts argv with stdout/stderr into log: truncated first when trunc,
 * appended to otherwise. */
PROC_FN pid_t spawn_log(char *const argv[], const char *log, int trunc) {
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | (trunc ? O_TRUNC : O_APPEND), 0644);
        if (fd >= 0) { dup2(fd, 1); dup2(fd, 2); close(fd); }
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

/* Starts argv with stdin from in (NULL: /dev/null) and stdout and stderr
 * into the files out and err (truncated), for a command whose two outputs
 * are checked apart. */
PROC_FN pid_t spawn_io(char *const argv[], const char *in, const char *out, const char *err) {
    pid_t pid = fork();
    if (pid == 0) {
        int i = open(in ? in : "/dev/null", O_RDONLY), o = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644),
            e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (i < 0 || o < 0 || e < 0) _exit(126);
        dup2(i, 0); dup2(o, 1); dup2(e, 2);
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

/* Starts argv with stdout/stderr appended to log. */
PROC_FN pid_t spawn(char *const argv[], const char *log) {
    return spawn_log(argv, log, 0);
}

/* The port from a port file, waiting for the process to write it. */
PROC_FN int wait_port(const char *file, pid_t pid, int timeout_ms) {
    double t0 = now_ms();
    while (now_ms() - t0 < timeout_ms) {
        FILE *f = fopen(file, "r");
        int port = 0;
        if (f) {
            int ok = fscanf(f, "%d", &port) == 1;
            fclose(f);
            if (ok && port > 0) return port;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return -1;
        sleep_ms(50);
    }
    return -1;
}

/* Starts argv, whose --port-file must be DIR/NAME.port, with its output in
 * DIR/NAME.log (truncated when trunc, else appended); checks that it wrote its
 * port within timeout_ms. The port, or -1. */
PROC_FN int start_named(pid_t *pid, char *const argv[], const char *dir, const char *name, int trunc, int timeout_ms) {
    char pf[512], log[512];
    snprintf(pf, sizeof pf, "%s/%s.port", dir, name);
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    unlink(pf);   /* a previous process's port file must not be read as ours */
    *pid = spawn_log(argv, log, trunc);
    int port = wait_port(pf, *pid, timeout_ms);
    CHECK(port > 0, "%s started (see %s)", name, log);
    return port;
}

/* `tandem serve EXTRA... --port-file DIR/NAME.port` through start_named
 * (its log DIR/NAME.log, truncated when trunc), 30 s to write its port
 * (120 s under ASan). The pid; *port is the port, or -1. */
PROC_FN pid_t start_serve(const char *dir, const char *name, char *const extra[], int trunc, int *port) {
    char pf[512];
    snprintf(pf, sizeof pf, "%s/%s.port", dir, name);
    char *argv[40];
    int k = 0;
    argv[k++] = (char *)bin();
    argv[k++] = "serve";
    for (int i = 0; extra[i] && k < 36; i++) argv[k++] = extra[i];
    argv[k++] = "--port-file";
    argv[k++] = pf;
    argv[k] = NULL;
    pid_t pid;
    *port = start_named(&pid, argv, dir, name, trunc, asan() ? 120000 : 30000);
    return pid;
}

/* Waits up to timeout_ms for pid to exit: its exit status (128 + the signal
 * when one ended it), or -1 when it had to be killed (SIGKILL, reaped) or
 * pid names no child. */
PROC_FN int wait_exit(pid_t pid, int timeout_ms) {
    if (pid <= 0) return -1;
    double t0 = now_ms();
    int st;
    while (now_ms() - t0 < timeout_ms) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (r < 0 && errno != EINTR) return -1;   /* not our child (any more): signal nothing */
        sleep_ms(20);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    return -1;
}

/* SIGTERM, then the exit status (or -1 if it had to be killed, or if pid
 * names no child: kill(0 or -1) would signal the whole process group). */
PROC_FN int stop_proc(pid_t pid, int timeout_ms) {
    if (pid <= 0) return -1;
    kill(pid, SIGTERM);
    return wait_exit(pid, timeout_ms);
}

/* ==== Files ==== */

/* A whole file (malloc'd, NUL-terminated), or NULL if it cannot be read. */
PROC_FN char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, n = 0, r;
    char *b = malloc(cap);
    while (b && (r = fread(b + n, 1, cap - n - 1, f)) > 0) {
        n += r;
        if (cap - n - 1 == 0) { char *nb = realloc(b, cap * 2); if (!nb) { free(b); b = NULL; break; } b = nb; cap *= 2; }
    }
    fclose(f);
    if (b) b[n] = 0;
    return b;
}

/* read_text(), but "" (malloc'd) for a file not there (yet). */
PROC_FN char *slurp(const char *path) {
    char *s = read_text(path);
    return s ? s : strdup("");
}

/* 1 once the file at path holds what (read again every 20 ms), 0 when it
 * still does not after wait_ms: a server's log line, written by another
 * process at its own pace. */
PROC_FN int wait_file_has(const char *path, const char *what, int wait_ms) {
    double t0 = now_ms();
    for (;;) {
        char *s = slurp(path);
        int r = strstr(s, what) != NULL;
        free(s);
        if (r || now_ms() - t0 > wait_ms) return r;
        sleep_ms(20);
    }
}

PROC_FN void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (f) { fputs(text, f); fclose(f); }
}

/* Occurrences of needle in hay (overlapping ones too; NULL hay: 0). */
PROC_FN int count_str(const char *hay, const char *needle) {
    int n = 0;
    for (const char *p = hay ? strstr(hay, needle) : NULL; p; p = strstr(p + 1, needle)) n++;
    return n;
}

/* A growing NUL-terminated buffer. membuf_add has the shape of libcurl's
 * write and header callbacks: sz * nm bytes at p onto the membuf ud; the
 * count taken (0 when out of memory, which makes libcurl stop). */
typedef struct { char *s; size_t len; } membuf;

PROC_FN size_t membuf_add(char *p, size_t sz, size_t nm, void *ud) {
    membuf *b = ud;
    size_t n = sz * nm;
    char *s = realloc(b->s, b->len + n + 1);
    if (!s) return 0;
    memcpy(s + b->len, p, n);
    b->s = s;
    b->len += n;
    s[b->len] = 0;
    return n;
}

/* ==== Python clients ====
 * The official `openai` Python client and `langchain-openai` (pydantic comes
 * with both), at the versions pinned in tests/clients/requirements.txt, in
 * a virtual environment under build/pyenv that tools/pyenv.sh makes on
 * first use (and again when the pins change; it locks, so binaries started
 * at once install once); tests/clients/openai_checks.py drives them
 * against a router. */
#define PY_CLIENTS_DIR "build/pyenv"

/* 1 when the clients are installed in build/pyenv (installing them first
 * where needed); 0 with a named skip ("python-clients", a failure where
 * TANDEM_REQUIRE names it) when python3's venv or pip cannot make them (the
 * log is build/pyenv-install.log). */
PROC_FN int py_clients_ready(const char *who) {
    static int state = -1;   /* this binary's answer, once known */
    if (state >= 0) return state;
    mkdir("build", 0755);
    int ok = system("tools/pyenv.sh >build/pyenv-install.log 2>&1") == 0;
    if (!ok) t_skip_what("python-clients", "%s: cannot install tests/clients/requirements.txt into " PY_CLIENTS_DIR
                         " (tools/pyenv.sh: python3 -m venv, pip; see build/pyenv-install.log)", who);
    return state = ok;
}

/* Runs tests/clients/openai_checks.py with args (NULL-terminated) in
 * build/pyenv's python. The script prints "ok NAME" or "FAIL NAME: why"
 * per check; each line is a check here, and one more checks that all
 * `want` of them ran and the script exited 0 (a crash halfway is a failure,
 * not fewer checks). */
PROC_FN void py_clients_run(const char *who, char *const args[], int want) {
    char *argv[40] = {PY_CLIENTS_DIR "/bin/python", "tests/clients/openai_checks.py"};
    int k = 2;
    for (int i = 0; args[i] && k < 39; i++) argv[k++] = args[i];
    argv[k] = NULL;
    int p[2];
    if (pipe(p)) { CHECK(0, "%s: pipe", who); return; }
    pid_t pid = fork();
    if (pid == 0) {
        dup2(p[1], 1); dup2(p[1], 2);
        close(p[0]); close(p[1]);
        execv(argv[0], argv);
        _exit(127);
    }
    close(p[1]);
    FILE *f = fdopen(p[0], "r");
    char line[4096], tail[4096] = "";
    int n = 0;
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!strncmp(line, "ok ", 3)) { n++; CHECK(1, "%s", line); }
        else if (!strncmp(line, "FAIL ", 5)) { n++; CHECK(0, "%s: python client: %s", who, line + 5); }
        else {   /* the other lines' last 3 KB or so, for the failure message */
            size_t tl = strlen(tail), ll = strlen(line);
            if (tl + ll + 2 > sizeof tail) { memmove(tail, tail + tl / 2, tl - tl / 2 + 1); tl = strlen(tail); }
            if (tl + ll + 2 <= sizeof tail) { memcpy(tail + tl, line, ll); tail[tl + ll] = '\n'; tail[tl + ll + 1] = 0; }
        }
    }
    if (f) fclose(f); else close(p[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    CHECK(n == want && rc == 0, "%s: python clients ran %d of %d checks, exit %d; other output:\n%s", who, n, want, rc, tail);
}

/* ==== Running to the end ==== */

/* Runs argv, returns its stdout (malloc'd) or NULL. */
PROC_FN char *run_capture(char *const argv[]) {
    int p[2];
    if (pipe(p)) return NULL;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(p[1], 1);
        close(p[0]); close(p[1]);
        int dn = open("/dev/null", O_WRONLY);
        if (dn >= 0) dup2(dn, 2);
        execv(argv[0], argv);
        _exit(127);
    }
    close(p[1]);
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    ssize_t r;
    while (buf && (r = read(p[0], buf + n, cap - n - 1)) > 0) {
        n += (size_t)r;
        if (cap - n - 1 == 0) { char *nb = realloc(buf, cap * 2); if (!nb) { free(buf); buf = NULL; break; } buf = nb; cap *= 2; }
    }
    close(p[0]);
    int st;
    waitpid(pid, &st, 0);
    if (buf) buf[n] = 0;
    if (!WIFEXITED(st) || WEXITSTATUS(st)) { free(buf); return NULL; }
    return buf;
}

/* The ids `tandem run --ids` printed (whitespace-separated integers), at
 * most cap of them into out; their count. */
PROC_FN int ids_parse(const char *s, int32_t *out, int cap) {
    int n = 0;
    const char *p = s;
    char *end;
    while (n < cap) {
        long v = strtol(p, &end, 10);
        if (end == p) break;
        out[n++] = (int32_t)v;
        p = end;
    }
    return n;
}

/* prompt into a fresh file made from the mkstemp template path; 0, or -1
 * (no file left behind). */
PROC_FN int prompt_file_make(char *path, const char *prompt) {
    int fd = mkstemp(path);
    if (fd < 0) return -1;
    size_t len = strlen(prompt);
    int ok = write(fd, prompt, len) == (ssize_t)len;
    close(fd);
    if (!ok) unlink(path);
    return ok ? 0 : -1;
}

/* run_ids's command line into argv (14 slots); np holds n_predict's text. */
PROC_FN void run_ids_argv(char **argv, const char *model, const char *prompt_path, char *np, size_t np_len, int chat,
                          int n_predict) {
    snprintf(np, np_len, "%d", n_predict);
    char *a[] = { (char *)bin(), "run", "-m", (char *)model, "-f", (char *)prompt_path, "-n", np, "--ids", "--ignore-eos",
                  "-t", "1", chat ? "--chat" : NULL, NULL };
    memcpy(argv, a, sizeof a);
}

/* `tandem run --ids --ignore-eos` on a prompt given as a file. */
PROC_FN int run_ids(const char *model, const char *prompt, int chat, int n_predict, int32_t *out, int cap) {
    char pf[] = "/tmp/tandem-test-prompt-XXXXXX";
    if (prompt_file_make(pf, prompt)) return -1;
    char np[16], *argv[14];
    run_ids_argv(argv, model, pf, np, sizeof np, chat, n_predict);
    char *o = run_capture(argv);
    unlink(pf);
    if (!o) return -1;
    int n = ids_parse(o, out, cap);
    free(o);
    return n;
}

/* run_ids started (run_ids_start) and collected (run_ids_end) apart, so
 * that a test's reference runs go side by side (each `tandem run -t 1` is
 * one core's work; a test that ran seven of them one after another spent
 * 8 s of its wall on them under ASan, the other core idle), or beside its
 * servers' start. */
typedef struct { pid_t pid; char prompt[40], out[40]; } run_job;

PROC_FN int run_ids_start(run_job *j, const char *model, const char *prompt, int chat, int n_predict) {
    snprintf(j->prompt, sizeof j->prompt, "/tmp/tandem-test-prompt-XXXXXX");
    snprintf(j->out, sizeof j->out, "/tmp/tandem-test-ids-XXXXXX");
    j->pid = -1;
    int fo = mkstemp(j->out);
    if (fo < 0) return -1;
    close(fo);
    if (prompt_file_make(j->prompt, prompt)) return -1;
    char np[16], *argv[14];
    run_ids_argv(argv, model, j->prompt, np, sizeof np, chat, n_predict);
    j->pid = spawn_io(argv, NULL, j->out, "/dev/null");
    return j->pid > 0 ? 0 : -1;
}

/* Waits (at most timeout_ms) for a run_ids_start's run: its ids, as run_ids. */
PROC_FN int run_ids_end(run_job *j, int timeout_ms, int32_t *out, int cap) {
    int rc = j->pid > 0 ? wait_exit(j->pid, timeout_ms) : -1;
    char *o = rc == 0 ? read_text(j->out) : NULL;
    unlink(j->prompt);
    unlink(j->out);
    if (!o) return -1;
    int n = ids_parse(o, out, cap);
    free(o);
    return n;
}

PROC_FN int count_fds(pid_t pid) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

/* The fewest open files over half a second: connections just answered may
 * still be closing on the server's threads. */
PROC_FN int settled_fds(pid_t pid) {
    int best = -1;
    for (int i = 0; i < 10; i++) {
        int n = count_fds(pid);
        if (n >= 0 && (best < 0 || n < best)) best = n;
        sleep_ms(50);
    }
    return best;
}

/* A kB line of /proc/PID/status by its key with the colon ("VmRSS:",
 * "VmHWM:" for the peak), or -1. */
PROC_FN long proc_status_kb(pid_t pid, const char *key) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long kb = -1;
    size_t kl = strlen(key);
    while (f && fgets(line, sizeof line, f)) if (!strncmp(line, key, kl)) kb = strtol(line + kl, NULL, 10);
    if (f) fclose(f);
    return kb;
}

PROC_FN long rss_kb(pid_t pid) {
    return proc_status_kb(pid, "VmRSS:");
}

/* CPU time (user + system) a process has used so far, in ms; -1 if unknown.
 * A server's own work, where wall time would also count a loaded machine. */
PROC_FN double cpu_ms(pid_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    unsigned long ut, stime;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &stime) != 2) return -1;
    return (double)(ut + stime) * 1000.0 / (double)sysconf(_SC_CLK_TCK);
}

/* ==== Sockets ==== */

/* Writes all n bytes (a blocking send may take part of them); 0, or -1 when
 * the peer or the send timeout stops it. */
PROC_FN int send_all(int fd, const void *p, size_t n) {
    for (size_t off = 0; off < n;) {
        ssize_t w = send(fd, (const char *)p + off, n - off, MSG_NOSIGNAL);
        if (w <= 0) return -1;
        off += (size_t)w;
    }
    return 0;
}

/* Reads exactly n bytes; 0, or -1 at EOF or an error first. */
PROC_FN int read_full(int fd, void *p, size_t n) {
    for (size_t got = 0; got < n;) {
        ssize_t r = read(fd, (char *)p + got, n - got);
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}

/* A listening socket on 127.0.0.1 at a port the kernel picks (into *port),
 * close-on-exec, non-blocking if nonblock (plat_socket: SOCK_NONBLOCK and
 * SOCK_CLOEXEC are Linux's). fd or -1. */
PROC_FN int listen_loopback(int *port, int nonblock) {
    int fd = plat_socket(AF_INET, SOCK_STREAM, 0, nonblock);
    struct sockaddr_in a = { .sin_family = AF_INET };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 16) || getsockname(fd, (struct sockaddr *)&a, &l)) {
        if (fd >= 0) close(fd);
        return -1;
    }
    *port = ntohs(a.sin_port);
    return fd;
}

/* ==== HTTP ==== */

/* A loopback port nothing listens on (bound, then closed), or -1. */
PROC_FN int dead_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t l = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &l) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

PROC_FN int http_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval tv = { asan() ? 120 : 60, 0 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) { close(fd); return -1; }
    return fd;
}

/* A node with a shared secret serves only signed requests (node_auth.h):
 * set while talking to one, requests are signed as the router signs them. */
static const node_auth_key *sign_key __attribute__((unused));

/* One request with every option, for tests of the signature checks. */
typedef struct {
    const char *method, *path, *body;
    const char *extra;           /* more header lines, each ending in \r\n */
    const node_auth_key *sign;   /* sign as a router does */
    const node_auth_sig *sig;    /* or send these signature headers as they are (replays) */
    int half_close;              /* shutdown(SHUT_WR) after sending */
    node_auth_sig used;          /* out: the signature headers sent */
} http_req;

PROC_FN int http_send_req(int fd, http_req *q) {
    char head[2048], sh[300] = "";
    size_t bl = q->body ? strlen(q->body) : 0;
    int signed_ = 0;
    if (q->sign) signed_ = !node_auth_sign(q->sign, q->method, q->path, q->body ? q->body : "", bl, node_auth_now_ms(), &q->used);
    else if (q->sig) { q->used = *q->sig; signed_ = 1; }
    if (signed_)
        snprintf(sh, sizeof sh, "%s: %s\r\n%s: %s\r\n%s: %s\r\n", NODE_AUTH_HDR_TIME, q->used.time, NODE_AUTH_HDR_NONCE,
                 q->used.nonce, NODE_AUTH_HDR_SIG, q->used.sig);
    int hl = snprintf(head, sizeof head,
                      "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n%s%s\r\n", q->method, q->path, bl, sh,
                      q->extra ? q->extra : "");
    if (hl < 0 || hl >= (int)sizeof head) return -1;
    if (send_all(fd, head, (size_t)hl) || send_all(fd, q->body, bl)) return -1;
    if (q->half_close) shutdown(fd, SHUT_WR);
    return 0;
}

/* A request with extra header lines ("Name: v\r\n"..., or NULL) after the
 * usual ones (and the signature's, with sign_key set). */
PROC_FN int http_send_hdr(int fd, const char *method, const char *path, const char *extra, const char *body) {
    http_req q = { .method = method, .path = path, .body = body, .extra = extra, .sign = sign_key };
    return http_send_req(fd, &q);
}

PROC_FN int http_send(int fd, const char *method, const char *path, const char *body) {
    return http_send_hdr(fd, method, path, NULL, body);
}

/* Everything the server sends until it closes (malloc'd), or NULL. */
PROC_FN char *http_read_all(int fd, size_t *len) {
    size_t cap = 8192, n = 0;
    char *buf = malloc(cap);
    ssize_t r;
    while (buf && (r = recv(fd, buf + n, cap - n - 1, 0)) > 0) {
        n += (size_t)r;
        if (cap - n - 1 == 0) { char *nb = realloc(buf, cap * 2); if (!nb) { free(buf); buf = NULL; break; } buf = nb; cap *= 2; }
    }
    if (buf) buf[n] = 0;
    *len = n;
    return buf;
}

/* Decodes a chunked body in place; returns its length. */
PROC_FN size_t dechunk(char *b, size_t n) {
    size_t in = 0, out = 0;
    while (in < n) {
        char *end;
        unsigned long sz = strtoul(b + in, &end, 16);
        char *crlf = strstr(b + in, "\r\n");
        if (!crlf || end == b + in) break;
        in = (size_t)(crlf - b) + 2;
        if (sz == 0 || in + sz > n) break;
        memmove(b + out, b + in, sz);
        out += sz;
        in += sz + 2;
    }
    b[out] = 0;
    return out;
}

/* Reads the whole response (the server closes). Returns the status; *body malloc'd. */
PROC_FN int http_read(int fd, char **body) {
    size_t n;
    char *buf = http_read_all(fd, &n);
    *body = NULL;
    if (!buf) return -1;
    int status = -1;
    char *sep = strstr(buf, "\r\n\r\n");
    if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1 || !sep) { free(buf); return -1; }
    *sep = 0;
    int chunked = strcasestr(buf, "transfer-encoding: chunked") != NULL;
    size_t off = (size_t)(sep + 4 - buf), bl = n - off;
    memmove(buf, buf + off, bl);
    buf[bl] = 0;
    if (chunked) dechunk(buf, bl);
    *body = buf;
    return status;
}

PROC_FN int http(int port, const char *method, const char *path, const char *req, char **body) {
    int fd = http_connect(port);
    *body = NULL;
    if (fd < 0) return -1;
    int st = http_send(fd, method, path, req) ? -1 : http_read(fd, body);
    close(fd);
    return st;
}

/* q on a connection of its own; the status (-1 when no answer came) and
 * the decoded body in *body (malloc'd; "" when none came, never NULL). */
PROC_FN int http_request(int port, http_req *q, char **body) {
    *body = NULL;
    int fd = http_connect(port);
    int st = fd < 0 || http_send_req(fd, q) ? -1 : http_read(fd, body);
    if (fd >= 0) close(fd);
    if (!*body) *body = strdup("");
    return st;
}

/* POSTs req (consumed) as JSON to path and leaves the response unread (a
 * stream to read, or to walk away from): the socket, or -1. */
PROC_FN int http_open_json(int port, const char *path, json_t *req) {
    char *s = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    int fd = s ? http_connect(port) : -1;
    if (fd >= 0 && http_send(fd, "POST", path, s)) { close(fd); fd = -1; }
    free(s);
    return fd;
}

/* A request with extra header lines (or NULL); the whole response, headers
 * and undecoded body, into *raw (malloc'd); the HTTP status. */
PROC_FN int http_raw(int port, const char *method, const char *path, const char *extra, const char *body, char **raw) {
    *raw = NULL;
    int fd = http_connect(port);
    if (fd < 0) return -1;
    size_t n;
    char *buf = http_send_hdr(fd, method, path, extra, body) ? NULL : http_read_all(fd, &n);
    close(fd);
    if (!buf) return -1;
    *raw = buf;
    int status = -1;
    return sscanf(buf, "HTTP/1.%*d %d", &status) == 1 ? status : -1;
}

/* A header's value in a raw response (case-insensitive name) into out, ""
 * if absent; out. */
PROC_FN const char *http_header(const char *raw, const char *name, char *out, size_t n) {
    out[0] = 0;
    const char *end = raw ? strstr(raw, "\r\n\r\n") : NULL;
    size_t nl = strlen(name);
    for (const char *p = raw ? strstr(raw, "\r\n") : NULL; p && p < end; p = strstr(p + 2, "\r\n")) {
        if (strncasecmp(p + 2, name, nl) || p[2 + nl] != ':') continue;
        const char *v = p + 3 + nl, *e = strstr(v, "\r\n");
        while (*v == ' ') v++;
        snprintf(out, n, "%.*s", (int)(e - v), v);
        break;
    }
    return out;
}

/* The value after series (its name and labels, with the trailing space) at
 * the start of a line of the /metrics page (so "x_total " is not found in
 * "y_x_total "), or -1 when the page or the series is missing. */
PROC_FN double metric_value(int port, const char *series) {
    char *m = NULL;
    http(port, "GET", "/metrics", NULL, &m);
    double v = -1;
    char *p = m ? strstr(m, series) : NULL;
    while (p && p > m && p[-1] != '\n') p = strstr(p + 1, series);
    if (p) v = atof(p + strlen(series));
    free(m);
    return v;
}

/* ==== JSON helpers ==== */

PROC_FN json_t *post_json(int port, json_t *req, int *status) {
    char *s = json_dumps(req, JSON_COMPACT), *body = NULL;
    json_decref(req);
    *status = http(port, "POST", "/v1/generate", s, &body);
    free(s);
    json_t *o = body ? json_loads(body, 0, NULL) : NULL;
    free(body);
    return o;
}

PROC_FN json_t *ids_json(const int32_t *ids, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

PROC_FN int same_ids(json_t *arr, const int32_t *ids, int n) {
    if (!json_is_array(arr) || (int)json_array_size(arr) != n) return 0;
    for (int i = 0; i < n; i++)
        if (json_integer_value(json_array_get(arr, (size_t)i)) != ids[i]) return 0;
    return 1;
}

PROC_FN long long jint(json_t *o, const char *path1, const char *path2) {
    json_t *v = json_object_get(o, path1);
    if (path2) v = json_object_get(v, path2);
    return json_integer_value(v);
}

PROC_FN const char *jstr(json_t *o, const char *path1, const char *path2) {
    json_t *v = json_object_get(o, path1);
    if (path2) v = json_object_get(v, path2);
    return json_is_string(v) ? json_string_value(v) : "";
}

/* What an OpenAI stream of up to 8 choices said, gathered per choice
 * index (chat: the deltas' content and roles; completions: the text). */
typedef struct {
    char text[8][512];
    char finish[8][16];
    int roles[8];            /* role deltas seen */
    int first_is_role[8];    /* the choice's first chunk carried the role */
    int chunks[8];
    int usage_prompt, usage_completion, done, errors, bad_index;
    char error[400];         /* the last error event's message */
} sse_choices;

PROC_FN void sse_gather(char *sse, int chat, int n, sse_choices *s) {
    memset(s, 0, sizeof *s);
    s->usage_prompt = s->usage_completion = -1;
    for (char *save = NULL, *l = strtok_r(sse, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        if (strncmp(l, "data: ", 6)) continue;
        if (!strcmp(l + 6, "[DONE]")) { s->done++; continue; }
        json_t *o = json_loads(l + 6, 0, NULL);
        if (json_object_get(o, "error")) {
            s->errors++;
            snprintf(s->error, sizeof s->error, "%s", jstr(json_object_get(o, "error"), "message", NULL));
        }
        json_t *u = json_object_get(o, "usage");
        if (json_is_object(u)) {
            s->usage_prompt = (int)jint(u, "prompt_tokens", NULL);
            s->usage_completion = (int)jint(u, "completion_tokens", NULL);
        }
        json_t *chs = json_object_get(o, "choices");
        for (size_t k = 0; k < json_array_size(chs); k++) {
            json_t *c = json_array_get(chs, k);
            long long i = jint(c, "index", NULL);
            if (i < 0 || i >= n || i >= 8) { s->bad_index++; continue; }
            json_t *d = json_object_get(c, "delta");
            const char *t = chat ? jstr(d, "content", NULL) : jstr(c, "text", NULL);
            if (chat && json_is_string(json_object_get(d, "role"))) {
                if (s->chunks[i] == 0) s->first_is_role[i] = 1;
                s->roles[i]++;
            }
            s->chunks[i]++;
            strncat(s->text[i], t, sizeof s->text[i] - strlen(s->text[i]) - 1);
            if (json_is_string(json_object_get(c, "finish_reason")))
                snprintf(s->finish[i], sizeof s->finish[i], "%s", json_string_value(json_object_get(c, "finish_reason")));
        }
        json_decref(o);
    }
}

/* A generation request on ids (greedy, ignore_eos). */
PROC_FN json_t *gen_req(const int32_t *ids, int n, int max_tokens, int stream, const char *prefill) {
    json_t *r = json_object();
    json_object_set_new(r, "tokens", ids_json(ids, n));
    json_object_set_new(r, "max_tokens", json_integer(max_tokens));
    json_object_set_new(r, "ignore_eos", json_true());
    if (stream) json_object_set_new(r, "stream", json_true());
    if (prefill) json_object_set_new(r, "prefill", json_string(prefill));
    return r;
}

/* Parses NDJSON lines: tokens into ids, returns the final object (or NULL). */
PROC_FN json_t *parse_stream(char *body, int32_t *ids, int cap, int *n) {
    json_t *done = NULL;
    *n = 0;
    for (char *save = NULL, *l = strtok_r(body, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        json_t *o = json_loads(l, 0, NULL);
        if (!o) continue;
        if (json_is_integer(json_object_get(o, "token")) && *n < cap) ids[(*n)++] = (int32_t)jint(o, "token", NULL);
        if (json_is_true(json_object_get(o, "done"))) { json_decref(done); done = o; continue; }
        json_decref(o);
    }
    return done;
}

/* ==== Generation requests ==== */

/* POST /v1/generate q (taken) at port, streamed (NDJSON) when stream is
 * set: up to cap generated tokens into tok (*n_tok), the status (-1: no
 * answer) in *status. Returns the final object (the stream's "done" line,
 * or the whole answer; NULL when none came); the caller frees it. */
PROC_FN json_t *gen_tokens(int port, json_t *q, int stream, int32_t *tok, int cap, int *n_tok, int *status) {
    json_t *o = NULL;
    *n_tok = 0;
    if (stream) {
        char *s = json_dumps(q, JSON_COMPACT), *body = NULL;
        json_decref(q);
        *status = http(port, "POST", "/v1/generate", s, &body);
        free(s);
        if (body) o = parse_stream(body, tok, cap, n_tok);
        free(body);
    } else {
        o = post_json(port, q, status);
        json_t *a = json_object_get(o, "tokens");
        for (size_t i = 0; json_is_array(a) && i < json_array_size(a) && *n_tok < cap; i++)
            tok[(*n_tok)++] = (int32_t)json_integer_value(json_array_get(a, i));
    }
    return o;
}

/* A top-level integer of a node's GET /v1/stats (-1 when it does not answer). */
PROC_FN long long stat_int(int port, const char *key) {
    char *body = NULL;
    int st = http(port, "GET", "/v1/stats", NULL, &body);
    json_t *o = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    long long v = o ? jint(o, key, NULL) : -1;
    json_decref(o);
    free(body);
    return v;
}

/* A golden file's prompts (its "prompt_ids", at most 200 tokens each, after
 * the header line) and, last, a long one: all of them `reps` times over, at
 * most long_cap tokens (<= 512). */
#define PROMPT_SET_MAX 9
typedef struct {
    int32_t ids[PROMPT_SET_MAX][512];
    int n[PROMPT_SET_MAX];
    int count;
} prompt_set;

PROC_FN int load_prompts(const char *golden, prompt_set *ps, int reps, int long_cap) {
    char *text = read_text(golden);
    if (!text) return -1;
    ps->count = 0;
    int line = 0;
    for (char *save = NULL, *l = strtok_r(text, "\n", &save); l && ps->count < PROMPT_SET_MAX - 1; l = strtok_r(NULL, "\n", &save)) {
        if (line++ == 0) continue;
        json_t *o = json_loads(l, 0, NULL);
        json_t *a = json_object_get(o, "prompt_ids");
        int n = 0;
        for (size_t i = 0; json_is_array(a) && i < json_array_size(a) && n < 200; i++)
            ps->ids[ps->count][n++] = (int32_t)json_integer_value(json_array_get(a, i));
        if (n > 0) ps->n[ps->count++] = n;
        json_decref(o);
    }
    free(text);
    int L = ps->count, n = 0;
    for (int rep = 0; rep < reps; rep++)
        for (int p = 0; p < L; p++)
            for (int i = 0; i < ps->n[p] && n < long_cap; i++) ps->ids[L][n++] = ps->ids[p][i];
    ps->n[L] = n;
    ps->count = L + 1;
    return 0;
}

/* ==== Source addresses ==== */

/* A TCP connection to 127.0.0.1:port from the loopback address src
 * ("127.0.x.y": 127.0.0.0/8 gives a test many client addresses), with
 * timeout_ms on sends and receives (blocking connect); timeout_ms 0: a
 * non-blocking socket, its connect left in progress (a flood that never
 * waits for the server). fd or -1. */
PROC_FN int connect_from(int port, const char *src, int timeout_ms) {
    int fd = plat_socket(AF_INET, SOCK_STREAM, 0, timeout_ms == 0);
    if (fd < 0) return -1;
    struct timeval tv = { timeout_ms / 1000, (timeout_ms % 1000) * 1000 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in s = { .sin_family = AF_INET }, a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if ((src && (inet_pton(AF_INET, src, &s.sin_addr) != 1 || bind(fd, (struct sockaddr *)&s, sizeof s))) ||
        (connect(fd, (struct sockaddr *)&a, sizeof a) && !(timeout_ms == 0 && errno == EINPROGRESS))) {
        close(fd);
        return -1;
    }
    return fd;
}

#endif

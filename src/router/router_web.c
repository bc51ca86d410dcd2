/* router_web.c - the router's chat page at GET / (docs/router.md, "The chat
 * page").
 *
 * The page is one file, src/router/web_page.html, with its CSS and script
 * inline and nothing loaded from anywhere else. The Makefile turns it into a
 * C array at build time ($(BUILD)/gen/web_page.c: rt_web_page_html,
 * rt_web_page_len), so the binary carries it and a router needs no files.
 *
 * Its Content-Security-Policy allows exactly the page's own inline <script>
 * and <style> (by their SHA-256, computed here once from the embedded
 * bytes, so an edit of the page cannot fall out of step with the policy),
 * fetches to this origin only, no frames around it, no forms sent
 * elsewhere, no plugins, no base URL: an injected script, an external
 * font or a framing site are all refused by the browser.
 *
 * The page asks HEAD / whether the router wants an API key (X-Tandem-Auth:
 * key or none); the key typed into it stays in the tab's sessionStorage
 * and goes out as Authorization: Bearer on its API requests.
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#include "router/router_web.h"

/* ==== The embedded page ($(BUILD)/gen/web_page.c) ==== */

extern const unsigned char rt_web_page_html[];
extern const size_t rt_web_page_len;

/* ==== Content-Security-Policy ==== */

static pthread_once_t rt_web_once = PTHREAD_ONCE_INIT;
static char rt_web_csp[512];

/* 'sha256-<base64>' of the bytes between open and close in the page
 * (the first such element), into out; "'none'" when there is none. */
static void rt_web_hash(const char *open, const char *close, char *out, size_t cap) {
    const char *page = (const char *)rt_web_page_html, *end = page + rt_web_page_len;
    const char *a = memmem(page, rt_web_page_len, open, strlen(open));
    const char *b = a ? memmem(a, (size_t)(end - a), close, strlen(close)) : NULL;
    unsigned char md[32];
    unsigned int mdlen = 0;
    unsigned char b64[48];   /* 4 * ceil(32 / 3) + NUL */
    if (!a || !b || !EVP_Digest(a + strlen(open), (size_t)(b - a - strlen(open)), md, &mdlen, EVP_sha256(), NULL) ||
        mdlen != sizeof md) {
        snprintf(out, cap, "'none'");
        return;
    }
    EVP_EncodeBlock(b64, md, (int)mdlen);
    snprintf(out, cap, "'sha256-%s'", (const char *)b64);
}

static void rt_web_init(void) {
    char script[64], style[64];
    rt_web_hash("<script>", "</script>", script, sizeof script);
    rt_web_hash("<style>", "</style>", style, sizeof style);
    /* img-src data: is the favicon (href="data:,"), which keeps the browser
     * from asking for /favicon.ico */
    snprintf(rt_web_csp, sizeof rt_web_csp,
             "default-src 'none'; script-src %s; style-src %s; connect-src 'self'; img-src data:; "
             "base-uri 'none'; form-action 'none'; frame-ancestors 'none'", script, style);
}

/* ==== GET / ==== */

enum MHD_Result rt_web_page(router *r, struct MHD_Connection *c) {
    pthread_once(&rt_web_once, rt_web_init);
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(rt_web_page_len, (void *)rt_web_page_html, MHD_RESPMEM_PERSISTENT);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, "Content-Type", "text/html; charset=utf-8");
    MHD_add_response_header(resp, "Content-Security-Policy", rt_web_csp);
    MHD_add_response_header(resp, "X-Frame-Options", "DENY");
    MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(resp, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(resp, "Cross-Origin-Opener-Policy", "same-origin");
    MHD_add_response_header(resp, "Cross-Origin-Resource-Policy", "same-origin");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    /* whether the API needs a key: the page asks (HEAD /) before its first
     * request, so that it never sends one only to have it refused */
    MHD_add_response_header(resp, "X-Tandem-Auth", r->cfg.api_key[0] ? "key" : "none");
    rt_count_request(r, RT_EP_OTHER, 200);
    enum MHD_Result mr = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return mr;
}

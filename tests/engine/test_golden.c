/* test_golden.c - tandem against llama.cpp's outputs (../shared/fixtures).
 *
 * For every golden file and prompt:
 *   - prompt ids equal the oracle's exactly;
 *   - teacher forcing on the oracle's tokens: at every step the oracle's
 *     top-10 logits and the L2 norm of all logits match within `tol`, and the
 *     argmax is the oracle's token wherever the oracle's top-1/top-2 gap
 *     exceeds `tol`;
 *   - free-running greedy output equals the oracle's up to the first step
 *     whose gap is below `tol` (on F16/F32 files: all 32 tokens).
 * Tolerances (logit units), with their evidence and tandem's measured worst
 * step per file: tests/data/README.md, "Tolerances". Evidence is the distance
 * between two independent oracles on the same file, ik_llama.cpp (the
 * fixture set's golden/) and mainline llama.cpp (golden-mainline/, and
 * tests/data/oracle/ for qwen3/qwen3moe, made by make_goldens.py there,
 * measured by compare_goldens.py): F32/F16 at most 0.023 (bar 3e-2);
 * quantized, the bar is the smallest multiple of 0.05 at or above 1.25x the
 * oracles' largest distance (Q8_0 0.349 -> 0.45, Q4_K_M 0.471 -> 0.60;
 * qwen2-mini-Q4_0 0.278 keeps its tighter 0.30). A bar is never raised to
 * make tandem pass; where tandem's worst step is above it, that is a
 * finding (see there). Every step of every file is held to its bar, except
 * qwen3moe-mini-Q4_K_M's listed excursions (with TANDEM_BACKEND=mlx, MLX's
 * own list of measured router near-ties instead of the CPU's) and
 * qwen3moe-mini-F16's one (a free-running near-tie), each printed with its
 * distance and reason.
 * Also: stories260K's 200-token greedy story from BOS, exactly.
 * TANDEM_BACKEND=cuda (a build with CUDA=1) runs it all on the CUDA backend;
 * without a CUDA device that is a counted "skipped: cuda: ..." line; a CUDA
 * backend that fails to start for any other reason is a failure.
 */
#include <jansson.h>
#include <math.h>

#include "engine/generate.h"
#include "engine/model.h"
#include "engine/quant.h"
#include "t.h"

/* SmolLM2 Q4_1 against llama-cpp-python's llama.cpp (4 prompts x 32
 * steps): tandem's top-10 logits are off by median 0.28-0.31, p95
 * 0.61-0.69, max 0.88-0.99 (ref, avx2, avx512 sets), its logit L2 by up to
 * 7.9% (the ref set, 136 of 1,724 at the step below). This model is that sensitive to precision: the oracle itself with an
 * F32 KV cache instead of F16 moves by median 0.28, p95 0.61, max 1.32, and
 * its L2 by up to 7.2% (top logits about 11, most logits near -7). So the
 * tolerances are the oracle's own spread; a broken kernel (a lost min term,
 * a wrong nibble) is off by whole units. The L2 bar is 10%: at
 * 00_short_english step 10 (top two 0.29 apart) the sets' norms spread
 * among themselves by 4.6% (ref 7.9% from the oracle, avx2/avx512 4.1%,
 * the NEON sets under qemu 8.7%, 2026-11-29), while their top-10 logits
 * stay within 1.05 there. */
#define SMOLLM2_TOL 1.4f
#define SMOLLM2_L2_REL 0.10f

/* A step known to leave the tolerance, named exactly (prompt and step) with
 * its reason: it is reported and not held to the tolerance, every other step
 * of the file is. */
typedef struct {
    const char *prompt;
    int step;
    const char *why;
} golden_excursion;

typedef struct {
    const char *golden, *dir_kind;
    float tol;          /* logit tolerance */
    int exact;          /* free-running must match all 32 tokens (up to a 0.005 near-tie) */
    const golden_excursion *excursions;   /* NULL-prompt-terminated, or NULL */
    float l2_rel;       /* the L2 norm's relative share of its tolerance (0: 0.25%, see check_step) */
    const golden_excursion *mlx_excursions;   /* with TANDEM_BACKEND=mlx, instead of excursions, or NULL */
} golden_case;

/* qwen3moe-mini-Q4_K_M's known excursions: the steps (of 256) where tandem
 * is more than the file's tolerance (0.60) from the oracle with any of the
 * x86-64 kernel sets (ref, avx2 = avxvnni, avx512: 40, 41 and 42 steps, 46
 * together), and one step whose argmax differs. Which steps cross moves
 * with rounding alone, so the list is the union over the sets; arm64's
 * sets are not measured. This is a finding, not a
 * tolerance: tests/data/README.md, "Tolerances". Each reason gives the
 * distance across the three sets and the smallest gap between the 2nd and
 * 3rd expert's router logit over the 4 layers at the step's token (measured
 * with a temporary print in the CPU backend's expert selection, avx512):
 * 28 of the 46 have one below 0.05 (a near-tie, where the oracle's
 * differently quantised activations can pick the other expert), against a
 * median of 0.109 at the steps within tolerance. The cause of the others
 * (2026-11-29, tests/data/oracle/moe_ties.py): 8-bit activations make
 * router gaps noisy. With the same expert choices everywhere, tandem's
 * 2nd/3rd router logit gap is up to 0.035 / 0.111 / 0.186 / 0.231 (layers
 * 0-3) from a float64 forward's that quantises the activations as ggml does
 * (a float64 forward whose activations move by 2^-22 before quantising
 * moves as far: 0.040 / 0.139 / 0.269 / 0.304), so a decision whose gap is
 * under its layer's bound may go either way in any implementation that
 * quantises activations, the oracles included; 0.05 was too small a bar
 * for layers 1-3. Of the 18 steps that had no near-tie under 0.05 at their
 * token, 12 have one under the bound (at the token or earlier) whose two
 * experts swapped bring tandem itself within 0.60 (each reason names it),
 * 2 more come mostly from earlier near-ties that the float64 forward
 * with f32 activations resolves the oracle's way (its choices in tandem's
 * routing: 3.45 -> 0.73, 2.50 -> 0.72), 3 (0.63-0.92) are 8-bit
 * rounding noise (within the float64 forward's jittered spread, or its
 * 0.53 from tandem on the same choices), and 1 (03_unicode_emoji_cjk 22) is
 * the oracle's own: tandem, MLX and every float64 variant agree there. No
 * tandem defect: the float64 forward on tandem's expert choices is within
 * 0.53 of tandem's logits at every step (median 0.21). The second oracle
 * (mainline llama.cpp, tests/data/oracle/qwen3moe-mini-Q4_K_M.jsonl) does
 * the same to ik_llama.cpp: 2.42 apart at worst before they part; of the 12
 * listed steps it reaches with ik's tokens, tandem is within 0.60 of it at 5
 * (the expert tandem chose is mainline's), the two oracles are over 0.60
 * apart at 5, and at 00_short_english 14 both oracles agree and tandem is
 * 4.8 from each: a near-tie at that token (layer 2, gap 0.063) that both
 * oracles resolve the other way (swapped, tandem is 0.33 and 0.32 from
 * them). Every other step is held to 0.60, and these
 * are printed with their distance on every run. */
/* qwen3-mini-Q4_K_M's one known excursion: with the avx2 kernel set (an
 * x86-64 without AVX-512) this step is 0.617 from ik_llama.cpp, over the
 * evidence-based bar of 0.60; the two oracles have parted on this prompt at
 * step 4, so they give no distance for it, and tandem is 0.396 from
 * mainline's golden there. Listed, printed on every run, not held. */
static const golden_excursion Q4KM_EXCURSIONS[] = {
    { "03_unicode_emoji_cjk", 9, "|dlogit| 0.54-0.62 (ref/avx512 within 0.60, avx2 0.617); the oracles parted on this prompt at step 4; 0.396 from mainline" },
    { NULL, 0, NULL },
};

static const golden_excursion MOE_Q4_EXCURSIONS[] = {
    { "00_short_english", 1, "|dlogit| 0.86-0.88; router near-tie at this token, 2nd/3rd expert logit gap 0.0466" },
    { "00_short_english", 3, "|dlogit| 0.62-0.63; router near-tie at this token, 2nd/3rd expert logit gap 0.0114" },
    { "00_short_english", 8, "|dlogit| 0.75-0.95; router near-tie at this token, 2nd/3rd expert logit gap 0.0161" },
    { "00_short_english", 14, "|dlogit| 4.76-4.83; router near-tie at this token within 8-bit activation noise: layer 2, 2nd/3rd expert logit gap 0.063 (layer 2 bound 0.186); those two swapped, tandem is 0.33 from ik_llama.cpp and 0.32 from mainline (the oracles agree here: 0.37 apart)" },
    { "00_short_english", 18, "|dlogit| 0.33-2.65; router near-tie at this token, 2nd/3rd expert logit gap 0.0128" },
    { "00_short_english", 26, "|dlogit| 2.85-2.88; router near-tie at this token within 8-bit activation noise: layer 3, 2nd/3rd expert logit gap 0.070 (layer 3 bound 0.231); those two swapped, 0.29" },
    { "00_short_english", 27, "|dlogit| 7.74-7.78; router near-tie at this token, 2nd/3rd expert logit gap 0.0340" },
    { "01_python_bug", 4, "|dlogit| 0.23-2.50; router near-tie at this token, 2nd/3rd expert logit gap 0.0006" },
    { "01_python_bug", 11, "|dlogit| 13.27-13.38; router near-tie at this token, 2nd/3rd expert logit gap 0.0011" },
    { "01_python_bug", 14, "|dlogit| 0.68-0.90; router near-tie at this token, 2nd/3rd expert logit gap 0.0296" },
    { "01_python_bug", 15, "|dlogit| 0.23-1.18; router near-tie at this token, 2nd/3rd expert logit gap 0.0032" },
    { "01_python_bug", 19, "top-10 within tolerance (|dlogit| 0.51-0.59) but the argmax differs from the oracle's (oracle gap 0.773, under twice the tolerance); 3 excursions earlier in this prompt" },
    { "01_python_bug", 22, "|dlogit| 0.75-0.79; router near-tie at this token, 2nd/3rd expert logit gap 0.0462" },
    { "01_python_bug", 31, "|dlogit| 2.04-2.04; router near-tie at this token within 8-bit activation noise: layer 3, 2nd/3rd expert logit gap 0.051 (layer 3 bound 0.231); those two swapped, 0.41 (the float64 forward chooses as tandem: 2.07)" },
    { "02_rubric_paragraph", 5, "|dlogit| 2.72-2.74; router near-tie at this token within 8-bit activation noise: layer 3, 2nd/3rd expert logit gap 0.056 (layer 3 bound 0.231); those two swapped, 0.20" },
    { "02_rubric_paragraph", 7, "|dlogit| 0.61-0.62; router near-tie at position 7 (this token: 66), layer 2, 2nd/3rd expert logit gap 0.0055; those two swapped, 0.55" },
    { "02_rubric_paragraph", 9, "|dlogit| 1.33-1.35; router near-tie at this token, 2nd/3rd expert logit gap 0.0123" },
    { "02_rubric_paragraph", 15, "|dlogit| 1.21-1.24; router near-tie at this token, 2nd/3rd expert logit gap 0.0209" },
    { "02_rubric_paragraph", 16, "|dlogit| 0.69-0.69; router near-tie at position 73 (this token: 75), layer 1, 2nd/3rd expert logit gap 0.0023; those two swapped, 0.58" },
    { "02_rubric_paragraph", 19, "|dlogit| 1.81-1.82; router near-tie at this token, 2nd/3rd expert logit gap 0.0372" },
    { "02_rubric_paragraph", 27, "|dlogit| 3.07-3.11; router near-tie at this token within 8-bit activation noise: layer 3, 2nd/3rd expert logit gap 0.097 (layer 3 bound 0.231); those two swapped, 0.31" },
    { "03_unicode_emoji_cjk", 0, "|dlogit| 0.62-0.72; router near-tie at position 1 (this token: 59), layer 0, 2nd/3rd expert logit gap 0.0081 (layer 0 bound 0.034); those two swapped, 0.37" },
    { "03_unicode_emoji_cjk", 5, "|dlogit| 0.51-0.61; router near-tie at this token, 2nd/3rd expert logit gap 0.0421" },
    { "03_unicode_emoji_cjk", 7, "|dlogit| 2.28-2.41; router near-tie at this token, 2nd/3rd expert logit gap 0.0401" },
    { "03_unicode_emoji_cjk", 11, "|dlogit| 0.59-0.65; router near-tie at position 1 (this token: 70), layer 0, 2nd/3rd expert logit gap 0.0081 (layer 0 bound 0.034); those two swapped, 0.28" },
    { "03_unicode_emoji_cjk", 22, "|dlogit| 1.19-1.33; the oracle's own: tandem, MLX and the float64 forward (8-bit activations, jittered 12 times: 1.06-1.29; f32 activations: 1.35) agree, no single or pair of tandem's near-tie decisions (of the 20 smallest) reaches ik_llama.cpp; the oracles parted at step 4, so no second opinion" },
    { "03_unicode_emoji_cjk", 23, "|dlogit| 3.91-3.99; router near-tie at this token, 2nd/3rd expert logit gap 0.0130" },
    { "03_unicode_emoji_cjk", 29, "|dlogit| 2.50-2.56; an earlier router near-tie within 8-bit activation noise: the float64 forward with f32 activations is 0.35 from the oracle, its expert choices differ from tandem's at 35 decisions that all follow from one near-tie (position 1, layer 0, gap 0.0081); with those, tandem's routing gives 0.72" },
    { "03_unicode_emoji_cjk", 30, "|dlogit| 0.86-0.92; 8-bit rounding noise: the float64 forward is 0.68 (jittered 0.24-0.80), tandem and it are up to 0.53 apart on the same expert choices; swapping the near-tie at position 39, layer 1 (gap 0.043) gives 0.54 in the float64 forward but 0.89 in tandem" },
    { "04_whitespace_newlines", 0, "|dlogit| 4.27-4.36; router near-tie at this token, 2nd/3rd expert logit gap 0.0324" },
    { "04_whitespace_newlines", 2, "|dlogit| 4.16-4.28; router near-tie at this token within 8-bit activation noise: layer 3, 2nd/3rd expert logit gap 0.122 (layer 3 bound 0.231); those two swapped, 0.53" },
    { "04_whitespace_newlines", 9, "|dlogit| 2.44-2.50; router near-tie at this token, 2nd/3rd expert logit gap 0.0307" },
    { "04_whitespace_newlines", 17, "|dlogit| 1.94-1.97; router near-tie at this token, 2nd/3rd expert logit gap 0.0301" },
    { "04_whitespace_newlines", 19, "|dlogit| 0.54-0.60; router near-tie at position 3 (this token: 45), layer 1, 2nd/3rd expert logit gap 0.0036; those two swapped, 0.50" },
    { "05_digits", 1, "|dlogit| 7.08-7.13; router near-tie at this token, 2nd/3rd expert logit gap 0.0004" },
    { "05_digits", 13, "|dlogit| 2.49-2.50; router near-tie at this token, 2nd/3rd expert logit gap 0.0139" },
    { "05_digits", 15, "|dlogit| 7.90-8.04; router near-tie at this token, 2nd/3rd expert logit gap 0.0094" },
    { "05_digits", 23, "|dlogit| 0.81-0.85; 8-bit rounding noise: the float64 forward with 8-bit activations is further from the oracle, 1.18 (jittered 0.58-1.43, 11 of 12 over 0.60); with f32 activations 0.36" },
    { "05_digits", 25, "|dlogit| 3.45-3.54; earlier router near-ties within 8-bit activation noise: the float64 forward with f32 activations is 0.24 from the oracle (with 8-bit ones 3.18-3.82), its expert choices differ from tandem's at 16 decisions that follow from two near-ties (position 30, layer 1, gap 0.042; position 94, layer 0, gap 0.0004); with those, tandem's routing gives 0.73" },
    { "05_digits", 28, "|dlogit| 1.04-1.13; router near-tie at this token within 8-bit activation noise: layer 3, 2nd/3rd expert logit gap 0.068 (layer 3 bound 0.231); those two swapped, 0.26" },
    { "05_digits", 30, "|dlogit| 2.43-2.51; router near-tie at this token, 2nd/3rd expert logit gap 0.0440" },
    { "06_chatml_chat", 16, "|dlogit| 0.35-1.10; router near-tie at this token, 2nd/3rd expert logit gap 0.0116" },
    { "06_chatml_chat", 18, "|dlogit| 0.30-2.30; router near-tie at this token, 2nd/3rd expert logit gap 0.0302" },
    { "06_chatml_chat", 20, "|dlogit| 2.60-2.61; router near-tie at this token, 2nd/3rd expert logit gap 0.0408" },
    { "06_chatml_chat", 24, "|dlogit| 6.63-6.71; router near-tie at this token, 2nd/3rd expert logit gap 0.0316" },
    { "07_long_gpl3", 2, "|dlogit| 1.08-1.09; router near-tie at this token, 2nd/3rd expert logit gap 0.0260 (layer 3); those two swapped, tandem is 0.22 from ik_llama.cpp and 0.14 from mainline (the oracles agree here: 0.17 apart)" },
    { "07_long_gpl3", 4, "|dlogit| 0.55-0.63; 8-bit rounding noise: 0.45 from mainline's golden, the two oracles 0.30 apart here; the float64 forward 0.56 (jittered 0.19-0.49), and it and tandem are up to 0.53 apart on the same expert choices; the near-ties at this token (layer 2 gap 0.104, layer 3 0.088) swapped give 0.78 and 1.29" },
    { NULL, 0, NULL },
};

/* qwen3moe-mini-Q4_K_M on the MLX backend (TANDEM_BACKEND=mlx, MLX's CPU
 * backend, 2026-11-29): MLX multiplies unrounded activations where the CPU
 * rounds them to 8-bit blocks as the oracle does, so it tips other router
 * near-ties and the CPU's list does not apply; this list replaces it there.
 * 29 of 256 steps are over 0.60 on MLX. A step is listed only where a
 * router near-tie explains it, by the CPU list's evidence and threshold:
 * the smallest gap between the 2nd and 3rd expert's router logit over the
 * 4 layers at the step's token below 0.05, measured on the MLX run or on
 * the CPU run of the same teacher-forced tokens (avx512 set; temporary
 * prints in moe_select_experts, tests/data/README.md, "Tolerances"). 21 of
 * the 29 have one on the MLX run, 5 more on the CPU run (2 where MLX picks
 * other experts than the CPU at that token, 3 where it picks the CPU's and
 * the CPU is off by as much, on its own list). The other 3 are NOT listed
 * and fail: 03_unicode_emoji_cjk 22 (smallest gap MLX 0.120, CPU 0.199),
 * 05_digits 28 (0.085, 0.068), 06_chatml_chat 10 (0.084, 0.070); cause not
 * established. For scale: at 71 of the 220 steps within 0.60 (steps 1-31)
 * one of the two runs has a gap below 0.05 too. Every step the CPU list
 * names but MLX keeps within 0.60 is held on MLX. Metal rounds otherwise
 * again: there the list is to be measured anew. */
static const golden_excursion MOE_Q4_MLX_EXCURSIONS[] = {
    { "00_short_english", 8, "MLX |dlogit| 0.97; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0018 (layers 0.311 0.133 0.068 0.002)" },
    { "00_short_english", 13, "MLX |dlogit| 5.19; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0112 (layers 0.167 0.011 0.697 0.954)" },
    { "00_short_english", 27, "MLX |dlogit| 7.53 (CPU 7.74, on its list); router near-tie at this token on the CPU run, 2nd/3rd expert logit gap 0.0340 (layer 0; MLX's smallest 0.058), and MLX picks the CPU's experts at every layer" },
    { "01_python_bug", 11, "MLX |dlogit| 9.10; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0384 (layers 0.489 0.038 0.058 0.541)" },
    { "01_python_bug", 15, "MLX |dlogit| 1.10; router near-tie at this token on the CPU run, 2nd/3rd expert logit gap 0.0032 (layer 3; MLX's 0.071 there), where MLX picks other experts than the CPU" },
    { "01_python_bug", 31, "MLX |dlogit| 1.90; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0336 (layers 0.204 0.595 0.530 0.034)" },
    { "02_rubric_paragraph", 9, "MLX |dlogit| 1.28; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0133 (layers 0.403 0.013 1.235 0.108)" },
    { "02_rubric_paragraph", 14, "MLX |dlogit| 8.02 (CPU 0.38); router near-tie at this token on the CPU run, 2nd/3rd expert logit gap 0.0023 (layer 1; MLX's 0.075 there), where MLX picks other experts than the CPU" },
    { "02_rubric_paragraph", 15, "MLX |dlogit| 1.23; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0017 (layers 0.273 1.470 0.458 0.002)" },
    { "02_rubric_paragraph", 18, "MLX |dlogit| 1.11; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0034 (layers 1.209 0.674 0.781 0.003)" },
    { "03_unicode_emoji_cjk", 5, "MLX |dlogit| 4.07; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0208 (layers 0.573 0.183 0.498 0.021)" },
    { "03_unicode_emoji_cjk", 7, "MLX |dlogit| 2.29; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0429 (layers 0.043 0.709 0.427 0.945)" },
    { "03_unicode_emoji_cjk", 10, "MLX |dlogit| 9.53; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0037 (layers 1.664 0.004 0.347 0.037)" },
    { "03_unicode_emoji_cjk", 20, "MLX |dlogit| 1.70; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0145 (layers 0.844 0.472 0.401 0.014)" },
    { "03_unicode_emoji_cjk", 22, "MLX |dlogit| 1.35, the CPU's own 1.33 (on its list: the oracle's own, where tandem and a float64 forward agree): no near-tie at this token on either run (smallest gaps 0.120 MLX, 0.199 CPU); with the CPU's expert sets at every position MLX gives 1.21, so MLX agrees with the CPU reference here and the distance is the CPU's from the oracle (issue 37)" },
    { "03_unicode_emoji_cjk", 23, "MLX |dlogit| 4.37 (CPU 3.91, on its list); router near-tie at this token on the CPU run, 2nd/3rd expert logit gap 0.0130 (layer 1; MLX's smallest 0.073), and MLX picks the CPU's experts at every layer" },
    { "03_unicode_emoji_cjk", 28, "MLX |dlogit| 6.36; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0253 (layers 0.177 0.025 2.051 0.600)" },
    { "04_whitespace_newlines", 0, "MLX |dlogit| 4.34; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0078 (layers 0.796 0.008 0.878 0.052)" },
    { "04_whitespace_newlines", 1, "MLX |dlogit| 5.86; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0036 (layers 0.533 0.500 0.004 0.097)" },
    { "04_whitespace_newlines", 2, "MLX |dlogit| 4.37; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0125 (layers 0.589 0.242 0.506 0.012)" },
    { "05_digits", 15, "MLX |dlogit| 7.98; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0050 (layers 0.188 0.213 0.005 0.710)" },
    { "05_digits", 18, "MLX |dlogit| 2.22; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0313 (layers 0.212 0.761 0.499 0.031)" },
    { "05_digits", 24, "MLX |dlogit| 13.99; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0114 (layers 1.083 0.011 0.038 0.622)" },
    { "05_digits", 28, "MLX |dlogit| 0.85, nearer the oracle than the CPU's own 1.04 (on its list: a near-tie at this token, layer 3, gap 0.068, under 8-bit activation noise): no near-tie at this token on either run (smallest gaps 0.085 MLX, 0.068 CPU); with the CPU's expert sets at every position MLX gives 0.89: the distance is the CPU's from the oracle (issue 37)" },
    { "05_digits", 30, "MLX |dlogit| 2.23 (CPU 2.51, on its list); router near-tie at this token on the CPU run, 2nd/3rd expert logit gap 0.0440 (layer 3; MLX's smallest 0.066), and MLX picks the CPU's experts at every layer" },
    { "06_chatml_chat", 10, "MLX |dlogit| 0.68 (CPU 0.35): no near-tie at this token (gaps 0.084 MLX, 0.070 CPU), but MLX and the CPU pick other experts at exactly 3 earlier (position, layer) pairs, all near-ties (15/2: 0.028, 0.025; 19/2: 0.0002, 0.065; 27/3: 0.045, 0.060); with the CPU's sets at those 3, MLX gives 0.587, within 0.60" },
    { "06_chatml_chat", 16, "MLX |dlogit| 1.09; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0381 (layers 0.177 0.156 0.038 0.345)" },
    { "06_chatml_chat", 23, "MLX |dlogit| 12.68; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0036 (layers 0.004 0.050 0.281 0.130)" },
    { "06_chatml_chat", 24, "MLX |dlogit| 6.79; router near-tie at this token on MLX, 2nd/3rd expert logit gap 0.0374 (layers 0.269 0.526 0.037 0.203)" },
    { NULL, 0, NULL },
};

/* qwen3moe-mini-F16's one known excursion, a final-logit near-tie: at
 * 05_digits step 6 the oracle's top two are 0.0063 apart (mainline's
 * golden: 0.0045, the same order), under F16 noise. Since the MoE experts'
 * inputs are rounded to F16 as both oracles round them (backend_cpu.c,
 * moe_round_f16), tandem is within 0.010 of ik_llama.cpp there but with
 * the avx2/avx512 sets puts the 2nd token 0.0025 above the 1st (the ref set
 * and a float64 forward keep the oracle's order), so free running parts
 * there. Teacher-forced it is within tolerance; listed so that free running
 * is held up to it, and printed on every run. */
static const golden_excursion MOE_F16_EXCURSIONS[] = {
    { "05_digits", 6, "final-logit near-tie: oracle top-1/top-2 gap 0.0063 (mainline 0.0045), |dlogit| 0.010 (avx2/avx512), 0.017 (ref); avx2/avx512 order the two the other way by 0.0025, ref as the oracle" },
    { NULL, 0, NULL },
};

static const golden_case CASES[] = {
    { "golden/visible/stories260K.jsonl", "fixture", 3e-2f, 1, NULL, 0, NULL },
    { "golden/visible/stories260K-F16.jsonl", "fixture", 3e-2f, 1, NULL, 0, NULL },
    { "golden-mainline/visible/stories260K.jsonl", "fixture", 3e-2f, 1, NULL, 0, NULL },
    { "golden-mainline/visible/stories260K-F16.jsonl", "fixture", 3e-2f, 1, NULL, 0, NULL },
    /* qwen3 F16: the two oracles are 0.0176 apart at most on qwen3-mini-F16
     * (bar 3e-2 as for every F16 file); on qwen3moe-mini-F16 0.021 at the
     * median but up to 1.64 at router near-ties (4 of 8 prompts part). tandem
     * against ik_llama.cpp: 0.0002 and, on qwen3moe-mini-F16 (experts' inputs
     * rounded to F16, 2026-11-28), median 0.0024 p95 0.0050 max 0.0105
     * (avx2/avx512; ref 0.0035 / 0.0077 / 0.0170), was 0.0048 / 0.0093 /
     * 0.0200 unrounded; one free-running near-tie, MOE_F16_EXCURSIONS. */
    { "golden/visible/qwen3-mini-F16.jsonl", "generated", 3e-2f, 1, NULL, 0, NULL },
    { "golden/visible/qwen3moe-mini-F16.jsonl", "generated", 3e-2f, 1, MOE_F16_EXCURSIONS, 0, NULL },
    { "golden/visible/qwen2-mini-F16.jsonl", "generated", 3e-2f, 1, NULL, 0, NULL },
    { "golden-mainline/visible/qwen2-mini-F16.jsonl", "generated", 3e-2f, 1, NULL, 0, NULL },
    /* Quantised files: each implementation quantises the activations its
     * own way. qwen3-mini-Q8_0: the two oracles are 0.349 apart at most
     * (median 0.167, p95 0.260, 105 steps where their greedy tokens agree;
     * they part on all 8 prompts, at top-1/top-2 gaps up to 0.16), so the
     * bar is 0.45 (1.25 x 0.349, rounded up to 0.05). tandem's worst step
     * against ik_llama.cpp 0.373 / 0.409 / 0.362 (ref / avx2 /
     * avx512, 2026-11-28); against mainline 0.306 (avx512), 0.303 (avx2). */
    { "golden/visible/qwen3-mini-Q8_0.jsonl", "fixture", 0.45f, 0, NULL, 0, NULL },
    /* qwen3-mini-Q4_K_M: the two oracles are 0.471 apart at most (median
     * 0.244, p95 0.395, 104 common steps), so the bar is 0.60 (1.25 x
     * 0.471, rounded up to 0.05). It had been raised to 0.65 by 4efe4b2
     * after a kernel change moved tandem's worst step (avx2) to 0.617: that
     * followed tandem, not an oracle, and is undone. tandem's worst step
     * against ik_llama.cpp 0.542 / 0.617 / 0.542 (ref / avx2 / avx512,
     * 2026-11-28): with avx2 (an x86-64 without AVX-512) one step,
     * 03_unicode_emoji_cjk 9, is 0.017 over the bar: a finding, not a
     * reason to raise it (that step comes after the two oracles part on that
     * prompt, so they give no distance for it), listed in Q4KM_EXCURSIONS.
     * Against mainline 0.475 (avx512), 0.396 (avx2). */
    { "golden/visible/qwen3-mini-Q4_K_M.jsonl", "fixture", 0.60f, 0, Q4KM_EXCURSIONS, 0, NULL },
    /* MoE + quantised: every step held to 0.60, the bar of the dense file
     * of the same weight type (qwen3-mini-Q4_K_M's oracle evidence), except
     * the listed excursions (MOE_Q4_EXCURSIONS, 47 of 256 steps, worst
     * 13.38): near-tied router decisions that pick a different expert,
     * logits several units apart. The two oracles do the same to each
     * other on this file: median 0.306 but p95 1.34, max 2.42 over the 52
     * steps before their greedy tokens part (all 8 prompts part, 4 of them
     * by step 5). Was: 75% of steps, checked only with at least 100 steps,
     * so never under the sanitizers. On MLX: MOE_Q4_MLX_EXCURSIONS (26
     * near-ties at the step's token; 2 steps on the CPU list where MLX is
     * as far from the oracle as the CPU or nearer, with the CPU's experts
     * swapped in too; 1 explained by 3 earlier near-tie expert choices,
     * shown by swapping exactly those). */
    { "golden/visible/qwen3moe-mini-Q4_K_M.jsonl", "fixture", 0.60f, 0, MOE_Q4_EXCURSIONS, 0, MOE_Q4_MLX_EXCURSIONS },
    /* qwen2-mini-Q4_0: the two oracles are 0.2775 apart at most (median
     * 0.133, over the 162 steps where their greedy tokens agree; mainline
     * c392e50 and llama-cpp-python 0.3.36 give bit-identical goldens here);
     * tandem's worst step 0.2936 against ik_llama.cpp, 0.2734 against
     * mainline. 0.30 is tighter than the 1.25x rule (0.35) and kept. */
    { "golden/visible/qwen2-mini-Q4_0.jsonl", "fixture", 0.30f, 0, NULL, 0, NULL },
    { "golden-mainline/visible/qwen2-mini-Q4_0.jsonl", "fixture", 0.30f, 0, NULL, 0, NULL },
    /* A real model (tools/models.sh) against mainline llama.cpp (the script
     * beside the file made it), with every kernel set this CPU runs: the
     * same activation quantisation (Q8_1 for Q4_1, Q8_0 for the tied
     * output); see SMOLLM2_TOL. */
    { "tests/data/oracle/smollm2-Q4_1.jsonl", "real", SMOLLM2_TOL, 0, NULL, SMOLLM2_L2_REL, NULL },
    /* The second oracle on the qwen3 files (mainline llama.cpp through
     * llama-cpp-python 0.3.36, tests/data/oracle/make_goldens.py, the same
     * prompt ids; the models are the fixture set's or the generated ones),
     * with the same bars as the ik_llama.cpp files. tandem's worst step
     * against it, 2026-11-28 (avx512 / avx2): F16 0.0176, Q8_0 0.306 / 0.303,
     * Q4_K_M 0.475 / 0.396.
     * The qwen3moe files from the same script are evidence only (the
     * README's table), not held here: on them the two oracles part by whole
     * logits at router near-ties (F16 up to 1.64, Q4_K_M 2.42) and tandem
     * follows ik_llama.cpp's choices on F16 (within 0.02) so that against
     * mainline 91 of 256 F16 steps leave 3e-2 (worst 14.4), which would
     * need an excursion list of its own. */
    { "tests/data/oracle/qwen3-mini-F16.jsonl", "generated", 3e-2f, 1, NULL, 0, NULL },
    { "tests/data/oracle/qwen3-mini-Q8_0.jsonl", "fixture", 0.45f, 0, NULL, 0, NULL },
    { "tests/data/oracle/qwen3-mini-Q4_K_M.jsonl", "fixture", 0.60f, 0, NULL, 0, NULL },
};

static int load_ids(json_t *arr, int32_t *out, int cap) {
    size_t i;
    json_t *v;
    int n = 0;
    json_array_foreach(arr, i, v) { if (n < cap) out[n] = (int32_t)json_integer_value(v); n++; }
    return n;
}

static double l2(const float *x, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += (double)x[i] * x[i];
    return sqrt(s);
}

typedef struct {
    double max_diff, max_held;   /* worst step of all, worst of those held to tol */
    int steps, within, argmax_checked, argmax_ok, prompts, excursions;
    float diffs[4096];
} file_stats;

/* The reason if (prompt, step) is a listed excursion of gc (its MLX list
 * where TANDEM_BACKEND=mlx and it has one), else NULL. */
static const char *excursion_why(const golden_case *gc, const char *prompt, int k) {
    const char *b = getenv("TANDEM_BACKEND");
    const golden_excursion *list = gc->mlx_excursions && b && !strcmp(b, "mlx") ? gc->mlx_excursions : gc->excursions;
    for (const golden_excursion *e = list; e && e->prompt; e++)
        if (e->step == k && prompt && !strcmp(e->prompt, prompt)) return e->why;
    return NULL;
}

/* Compare one step's logits with the oracle's; returns the top1-top2 gap.
 * Every step is held to tol, except a listed excursion (why != NULL), which
 * is printed with its distance and reason instead. TANDEM_GOLDEN_DUMP=1
 * prints every step's distance (how the tolerance table was measured). */
static double check_step(const char *name, int k, json_t *step, const float *logits, int n_vocab,
                         float tol, float l2_rel, const char *why, file_stats *fs) {
    json_t *top = json_object_get(step, "top10");
    size_t i;
    json_t *pair;
    double worst = 0;
    json_array_foreach(top, i, pair) {
        int id = (int)json_integer_value(json_array_get(pair, 0));
        double want = json_number_value(json_array_get(pair, 1));
        double d = fabs(logits[id] - want);
        if (d > worst) worst = d;
    }
    double want_l2 = json_number_value(json_object_get(step, "logit_l2"));
    double dl2 = fabs(l2(logits, n_vocab) - want_l2);
    /* The L2 norm sums all 151936 logits; its error is held to 8 x tol plus
     * 0.25% (quantised qwen2-mini's norm is ~3100 and moves by up to 4.5
     * between implementations that quantise activations differently). */
    double l2_tol = tol * 8 + (l2_rel > 0 ? l2_rel : 0.0025) * want_l2;
    int ok = worst <= tol && dl2 <= l2_tol;
    fs->within += ok;
    double g1 = json_number_value(json_array_get(json_array_get(top, 0), 1));
    double g2 = json_number_value(json_array_get(json_array_get(top, 1), 1));
    if (getenv("TANDEM_GOLDEN_DUMP"))
        printf("  dump %s step %d: |dlogit| %.4f dL2 %.4f oracle gap %.4f\n", name, k, worst, dl2, g1 - g2);
    if (why) {
        fs->excursions++;
        printf("  known excursion %s step %d: top-10 |dlogit| %.3f (tol %.2f), not held to tol: %s\n", name, k, worst,
               tol, why);
    } else {
        CHECK(worst <= tol, "%s step %d: top-10 logit differs by %.4f (tol %.3f)", name, k, worst, tol);
        CHECK(dl2 <= l2_tol, "%s step %d: logit L2 %.4f vs %.4f", name, k, l2(logits, n_vocab), want_l2);
        if (worst > fs->max_held) fs->max_held = worst;
    }
    if (worst > fs->max_diff) fs->max_diff = worst;
    if (fs->steps < 4096) fs->diffs[fs->steps] = (float)worst;
    return g1 - g2;
}

typedef struct { int32_t *o; int *n; } collector;

static int collect(void *ud, int32_t id) {
    collector *c = ud;
    if (*c->n < 64) c->o[(*c->n)++] = id;
    return 0;
}

static void run_prompt(model *m, json_t *p, const golden_case *gc, file_stats *fs) {
    float tol = gc->tol;
    const char *name = json_string_value(json_object_get(p, "name"));
    const char *text = json_string_value(json_object_get(p, "prompt"));
    json_t *steps = json_object_get(p, "steps");
    int32_t want[4096], got[4096], gen[64];
    int nw = load_ids(json_object_get(p, "prompt_ids"), want, 4096);
    int ng = load_ids(json_object_get(p, "generated_ids"), gen, 64);
    if (getenv("TANDEM_ASAN") && ng > 8) ng = 8;   /* sanitizer run: same code paths, fewer steps */
    const tokenizer *tok = model_get_tokenizer(m);
    int64_t n = tokenizer_encode(tok, text, strlen(text), 1, 1, got, 4096);
    int same = n == nw;
    for (int i = 0; same && i < nw; i++) same = got[i] == want[i];
    CHECK(same, "%s: prompt ids differ (%lld vs %d tokens)", name, (long long)n, nw);

    const model_hparams *hp = model_get_hparams(m);
    char err[256];
    session *s = NULL;
    float *logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    CHECK(session_new(&s, m, 4096, GGML_TYPE_F16, err, sizeof err) == 0, "session: %s", err);
    if (!s || !logits) { free(logits); return; }
    /* teacher forcing */
    int ok = model_eval(m, s, want, nw, logits, NULL, NULL, err, sizeof err) == 0;
    CHECK(ok, "%s: eval failed: %s", name, err);
    int first_tie = ng;
    for (int k = 0; ok && k < ng; k++) {
        json_t *st = json_array_get(steps, (size_t)k);
        const char *why = excursion_why(gc, name, k);
        double gap = check_step(name, k, st, logits, hp->n_vocab, tol, gc->l2_rel, why, fs);
        fs->steps++;
        if (gap > tol && !why) {
            int am = sampler_argmax(logits, hp->n_vocab);
            fs->argmax_checked++;
            fs->argmax_ok += am == gen[k];
            CHECK(am == gen[k], "%s step %d: argmax %d, oracle %d (gap %.3f)", name, k, am, gen[k], gap);
        }
        /* free running can be held to the oracle only up to its first
         * near-tie, or the first listed excursion */
        if ((gap <= (gc->exact ? 0.005 : tol) || why) && k < first_tie) {
            first_tie = k;
        }
        if (k + 1 < ng) {
            ok = model_eval(m, s, &gen[k], 1, logits, NULL, NULL, err, sizeof err) == 0;
            CHECK(ok, "%s: eval after step %d failed: %s", name, k, err);
        }
    }
    /* free running */
    session_reset(s, 0);
    sampler_params sp = sampler_defaults();
    sp.temp = 0;
    sampler *smp = sampler_new(&sp, hp->n_vocab);
    int32_t out[64];
    int nout = 0;
    collector cap = { out, &nout };
    gen_opts go = { .max_tokens = ng, .ignore_eos = 1, .on_token = collect, .ud = &cap };
    gen_stats gs;
    ok = generate_run(m, s, smp, want, nw, logits, 0, &go, &gs, err, sizeof err) == 0;
    CHECK(ok, "%s: generate failed: %s", name, err);
    int agree = 0;
    while (agree < nout && agree < ng && out[agree] == gen[agree]) agree++;
    CHECK(agree >= first_tie, "%s: free-running greedy agrees for %d tokens, needed %d", name, agree, first_tie);
    fs->prompts++;
    sampler_free(smp);
    session_free(s);
    free(logits);
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void run_file(const golden_case *gc) {
    char path[1024], mpath[1024];
    int real = !strcmp(gc->dir_kind, "real");
    /* tests/data/... goldens are in the repository (the second oracle's);
     * their models are still the fixture set's or the generated ones */
    int in_repo = real || !strncmp(gc->golden, "tests/", 6);
    if (in_repo) snprintf(path, sizeof path, "%s", gc->golden);
    else t_fixture_path(path, sizeof path, gc->golden);
    if (!in_repo && !t_need(path)) return;
    FILE *f = fopen(path, "r");
    CHECK(f != NULL, "cannot open %s", path);
    if (!f) return;
    char *line = NULL;
    size_t cap = 0;
    model *m = NULL;
    static file_stats fs;
    memset(&fs, 0, sizeof fs);
    while (getline(&line, &cap, f) > 0) {
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        CHECK(j != NULL, "%s: bad JSON: %s", path, je.text);
        if (!j) break;
        const char *type = json_string_value(json_object_get(j, "type"));
        if (type && !strcmp(type, "header")) {
            const char *mf = json_string_value(json_object_get(j, "model_file"));
            char rel[600];
            snprintf(rel, sizeof rel, "models/%s", mf ? mf : "");
            if (real) {
                if (!t_smollm2(mpath, sizeof mpath)) { json_decref(j); break; }
                CHECK(strstr(mpath, mf ? mf : "?") != NULL, "%s is for %s", path, mf ? mf : "?");
            } else if (!strcmp(gc->dir_kind, "fixture")) t_fixture_path(mpath, sizeof mpath, rel);
            else snprintf(mpath, sizeof mpath, "%s/%s", t_models(), mf);
            if (!real && !t_need(mpath)) { json_decref(j); break; }
            char err[512];
            model_opts mo = { .n_threads = 2, .n_batch = 512, .backend = getenv("TANDEM_BACKEND") };
            CHECK(model_load(&m, mpath, &mo, err, sizeof err) == 0, "load %s: %s", mpath, err);
        } else if (m) {
            /* Under the sanitizers, two prompts per file: the first and the
             * long one (1338 tokens: chunked prefill) cover every code path. */
            int idx = (int)json_integer_value(json_object_get(j, "index"));
            if (!getenv("TANDEM_ASAN") || idx == 0 || idx == 7) run_prompt(m, j, gc, &fs);
        }
        json_decref(j);
        if (!m) break;
    }
    /* a file whose model loaded must have run prompts: no silent pass */
    if (m) CHECK(fs.prompts > 0 && fs.steps > 0, "%s: no prompt ran (%d prompts, %d steps)", gc->golden, fs.prompts, fs.steps);
    qsort(fs.diffs, (size_t)(fs.steps < 4096 ? fs.steps : 4096), sizeof(float), cmp_float);
    if (fs.steps || !real)   /* a skipped real model: its skip line says it */
        printf("  %-44s %4d steps |dlogit| median %.4f p95 %.4f max %.4f (held steps %.4f) tol %.2f; in tol %d, "
               "argmax %d/%d, known excursions %d%s%s\n",
               gc->golden, fs.steps, fs.steps ? fs.diffs[fs.steps / 2] : 0.0,
               fs.steps ? fs.diffs[fs.steps * 95 / 100] : 0.0, fs.max_diff, fs.max_held, gc->tol, fs.within,
               fs.argmax_ok, fs.argmax_checked, fs.excursions, real ? " kernels " : "", real ? quant_kernel_name() : "");
    free(line);
    fclose(f);
    model_free(m);
}

static void run_story(void) {
    char path[1024], mpath[1024], err[512];
    t_fixture_path(path, sizeof path, "golden/stories260K_greedy200_expected.txt");
    t_fixture_path(mpath, sizeof mpath, "models/stories260K.gguf");
    if (!t_need(path)) return;
    FILE *f = fopen(path, "r");
    CHECK(f != NULL, "cannot open %s", path);
    if (!f) return;
    char want[4096] = { 0 };
    size_t nw = fread(want, 1, sizeof want - 1, f);
    fclose(f);
    model *m = NULL;
    session *s = NULL;
    model_opts mo = { .n_threads = 2, .backend = getenv("TANDEM_BACKEND") };
    CHECK(model_load(&m, mpath, &mo, err, sizeof err) == 0, "%s", err);
    if (!m) return;
    CHECK(session_new(&s, m, 512, GGML_TYPE_F16, err, sizeof err) == 0, "%s", err);
    const model_hparams *hp = model_get_hparams(m);
    float *logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    int32_t bos = tokenizer_bos(model_get_tokenizer(m));
    char text[8192];
    size_t nt = 0;
    tok_stream ts;
    tok_stream_init(&ts, model_get_tokenizer(m));
    int ev = model_eval(m, s, &bos, 1, logits, NULL, NULL, err, sizeof err);
    CHECK(ev == 0, "stories260K: eval of BOS failed: %s", err);
    for (int i = 0; !ev && i < 200; i++) {
        int32_t id = sampler_argmax(logits, hp->n_vocab);
        int n = tok_stream_push(&ts, id, text + nt, sizeof text - nt);
        if (n > 0) nt += (size_t)n;
        ev = model_eval(m, s, &id, 1, logits, NULL, NULL, err, sizeof err);
        CHECK(ev == 0, "stories260K: eval of story token %d failed: %s", i, err);
    }
    int n = tok_stream_flush(&ts, text + nt, sizeof text - nt);
    if (n > 0) nt += (size_t)n;
    text[nt] = 0;
    /* the reference file may end with a newline the story does not have */
    while (nw && (want[nw - 1] == '\n')) want[--nw] = 0;
    CHECK(strncmp(text, want, nw) == 0, "stories260K 200-token story differs:\n got: %s\nwant: %s", text, want);
    free(logits);
    session_free(s);
    model_free(m);
}

/* 1 if TANDEM_BACKEND names a backend that cannot start: a counted skip
 * where the machine has no CUDA device, else a failure with the cause. */
static int backend_missing(void) {
    const char *b = getenv("TANDEM_BACKEND");
    if (!b || !strcmp(b, "cpu")) return 0;
    char mpath[1024], err[512];
    t_fixture_path(mpath, sizeof mpath, "models/stories260K.gguf");
    model *m = NULL;
    model_opts mo = { .n_threads = 1, .backend = b };
    if (model_load(&m, mpath, &mo, err, sizeof err) == 0) { model_free(m); return 0; }
    if (!t_cuda_absent(err)) CHECK(0, "TANDEM_BACKEND=%s cannot start: %s", b, err);
    return 1;
}

/* 1 if the comma list names set */
static int golden_set_named(const char *list, const char *set) {
    size_t n = strlen(set);
    for (const char *p = list; p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
        if (!strncmp(p, set, n) && (p[n] == ',' || !p[n])) return 1;
    return 0;
}

int main(void) {
    if (backend_missing()) return t_done("test_golden");
    /* TANDEM_GOLDEN=substring runs only the matching files (for debugging) */
    const char *only = getenv("TANDEM_GOLDEN");
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        if (only && !strstr(CASES[i].golden, only)) continue;
        const char *b = getenv("TANDEM_BACKEND");
        if (strcmp(CASES[i].dir_kind, "real") || (b && strcmp(b, "cpu"))) { run_file(&CASES[i]); continue; }
        /* the real model on the CPU: every kernel set this CPU runs, or
         * those TANDEM_GOLDEN_SETS names (comma list: tests/peer_fit.sh's
         * emulated avxvnni set, whose other sets the suite's run has) */
        const char *sets[16], *best = quant_kernel_name(), *want = getenv("TANDEM_GOLDEN_SETS");
        int ns = quant_kernel_sets(sets, 16), ran = 0;
        for (int k = 0, skips = t_skip; k < ns && k < 16; k++) {
            if (want && !golden_set_named(want, sets[k])) continue;
            CHECK(quant_use_kernels(sets[k]) == 0, "kernel set %s", sets[k]);
            run_file(&CASES[i]);
            ran++;
            if (t_skip > skips) break;   /* no model: one skip, not one per set */
        }
        if (want) CHECK(ran > 0, "TANDEM_GOLDEN_SETS=%s: no such kernel set on this CPU", want);
        quant_use_kernels(best);
    }
    if (!only) run_story();
    return t_done("test_golden");
}

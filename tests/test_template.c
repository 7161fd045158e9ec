/*
 * test_template.c - the chat-template renderer (template/) against
 * jinja2 as transformers configures it (ImmutableSandboxedEnvironment with
 * trim_blocks, lstrip_blocks, loopcontrols; transformers' tojson,
 * raise_exception, strftime_now).
 *
 * Every expected string in the *_cases tables below was confirmed by
 * rendering the same template and context with real jinja2 3.1 in a
 * scratch venv, configured as transformers' _compile_jinja_template does
 * (the test itself is C and needs no Python). Each table pins one area:
 * how values print (Python str/repr: None, True, 1.0, 1e-05), the
 * operators, loops, scoping, macros, whitespace control, filters, tests,
 * methods, filter/generation blocks, attribute access. Then: what is
 * refused at compile (by name and line), syntax errors, raise_exception,
 * runtime errors, and the bounds (steps, depth, output, memory) ending a
 * hostile template with an error rather than a hang.
 */
#include "template.h"

#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct tpl_case {
    const char *src, *ctx, *want;
} tpl_case;

/* Compile and render src against the JSON ctx; the error code, with the
 * text in *out (malloc'd) on success and the message in msg either way. */
static int render(const char *src, const char *ctx, size_t max_out, char **out, char *msg,
                  size_t msg_len)
{
    tpl_template *t = NULL;
    *out = NULL;
    int err = tpl_compile(&t, src, strlen(src), msg, msg_len);
    if (err)
        return err;
    cJSON *j = ctx ? cJSON_Parse(ctx) : NULL;
    cr_assert(!ctx || j, "bad test context %s", ctx);
    size_t n = 0;
    err = tpl_render(t, j, max_out, out, &n, msg, msg_len);
    if (!err)
        cr_assert_eq(n, strlen(*out), "the length is the text's (no NUL inside)");
    cJSON_Delete(j);
    tpl_free(t);
    return err;
}

static void check_cases(const tpl_case *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char *out, msg[512] = "";
        int err = render(cases[i].src, cases[i].ctx, 0, &out, msg, sizeof msg);
        cr_expect_eq(err, QL_OK, "case %zu (%s) failed: %s", i, cases[i].src, msg);
        if (!err)
            cr_expect_str_eq(out, cases[i].want, "case %zu: %s", i, cases[i].src);
        free(out);
    }
}
#define CHECK(cases) check_cases(cases, sizeof cases / sizeof cases[0])

/* Render must fail with err and a message containing needle. */
static void expect_error(const char *src, const char *ctx, size_t max_out, int err,
                         const char *needle)
{
    char *out, msg[512] = "";
    int got = render(src, ctx, max_out, &out, msg, sizeof msg);
    cr_expect_eq(got, err, "%s: expected %s, got %s (%s)", src, ql_err_name(err), ql_err_name(got),
                 msg);
    cr_expect(strstr(msg, needle) != NULL, "%s: message '%s' lacks '%s'", src, msg, needle);
    cr_expect_null(out, "no text on error");
    free(out);
}

static const tpl_case printing_cases[] = {
    {"{{ 'a' }}{{ 1 }}{{ 1.0 }}{{ 1e-5 }}{{ 1.5e16 }}{{ 0.1 }}{{ 123.456 }}{{ -0.0 }}{{ 1e100 }}{{ "
     "2**10 }}{{ 2**-1 }}",
     "{}", "a11.01e-051.5e+160.1123.456-0.01e+10010240.5"},
    {"{{ none }}|{{ None }}|{{ true }}|{{ False }}|{{ undefined_var }}|{{ [1,'a',none,true] }}|{{ "
     "{'a':1,'b':[2]} }}|{{ (1,) }}|{{ (1,2) }}|{{ () }}",
     "{}", "None|None|True|False||[1, 'a', None, True]|{'a': 1, 'b': [2]}|(1,)|(1, 2)|()"},
    {"{{ \"it's\" }}{{ 'say \"hi\"' }}{{ ['it\\'s', 'a\"b', \"both'\\\"\"] }}{{ 'tab\\there' }}{{ "
     "'\\u00e9\\x41' }}",
     "{}", "it'ssay \"hi\"[\"it's\", 'a\"b', 'both\\'\"']tab\thereéA"},
    {"{{ 10000000000000000.0 }} {{ 1e16 }} {{ 123456789.123 }} {{ 0.0001 }} {{ 0.00001 }} {{ 1/3 "
     "}} {{ 2.0**0.5 }} {{ 100.0 }} {{ 5e-324 }}",
     "{}",
     "1e+16 1e+16 123456789.123 0.0001 1e-05 0.3333333333333333 1.4142135623730951 100.0 5e-324"},
};

static const tpl_case operators_cases[] = {
    {"{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 6 / 2 }} {{ 7.5 // 2 }} "
     "{{ -7.5 % 2 }} {{ 3 * 'ab' }} {{ [1] * 3 }} {{ 1 + 2.5 }} {{ true + 1 }}",
     "{}", "3 -4 -2 2 3.5 3.0 3.0 0.5 ababab [1, 1, 1] 3.5 2"},
    {"{{ 'ab' ~ 1 ~ none ~ x }}|{{ 'a' + 'b' }}|{{ [1] + [2] }}|{{ 1 < 2 }}{{ 'a' < 'b' }}{{ [1,2] "
     "< [1,3] }}{{ 1 == 1.0 }}{{ 1 == true }}{{ 'a' != 'a' }}",
     "{}", "ab1None|ab|[1, 2]|TrueTrueTrueTrueTrueFalse"},
    {"{{ 'a' in 'cat' }}{{ 1 in [1,2] }}{{ 'k' in {'k':1} }}{{ 3 not in [1] }}{{ not 1 }}{{ 1 and "
     "'x' }}{{ 0 or 'y' }}{{ '' or [] }}",
     "{}", "TrueTrueTrueTrueFalsexy[]"},
    {"{{ 'yes' if x else 'no' }}|{{ 'yes' if 1 }}|{{ 'a' if 0 }}|", "{\"x\": 1}", "yes|yes||"},
    {"{{ x }}|{{ x.y is defined }}|{{ [1,2,3][1:2] }}|{{ -x.n }}|{{ (1 + 2) * 3 }}|{{ 2 ** 3 ** 2 "
     "}}|{{ -2 ** 2 }}|{{ 1 - -1 }}",
     "{\"x\": {\"n\": 5}}", "{'n': 5}|False|[2]|-5|9|64|4|2"},
};

static const tpl_case loops_cases[] = {
    {"{% for x in items %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 "
     "}}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ "
     "loop.cycle('a','b') }};{% endfor %}",
     "{\"items\": [\"x\", \"y\", \"z\"]}", "1032TrueFalse3ya;2121FalseFalse3xzb;3210FalseTrue3ya;"},
    {"{% for x in [] %}a{% else %}empty{% endfor %}{% for x in [1,2,3,4] if x is even %}{{ x }}{{ "
     "loop.length }}{% endfor %}",
     "{}", "empty2242"},
    {"{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}{% for k in d %}{{ k }}{% endfor %}{% "
     "for a, b in [[1,2],[3,4]] %}{{ a+b }}{% endfor %}",
     "{\"d\": {\"b\": 1, \"a\": 2}}", "b=1,a=2,ba37"},
    {"{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% "
     "endif %}{{ x }}{% endfor %}",
     "{}", "0134"},
    {"{% for m in ms %}{% if loop.first and m.role == 'system' %}S{% elif m.role == 'user' %}U{% "
     "else %}O{% endif %}{% endfor %}",
     "{\"ms\": [{\"role\": \"system\"}, {\"role\": \"user\"}, {\"role\": \"x\"}]}", "SUO"},
};

static const tpl_case scoping_cases[] = {
    {"{% set ns = namespace(found=false, n=0) %}{% for m in msgs %}{% if m == 'b' %}{% set "
     "ns.found = true %}{% endif %}{% set ns.n = ns.n + 1 %}{% set local = 1 %}{% endfor %}{{ "
     "ns.found }}{{ ns.n }}{{ local }}",
     "{\"msgs\": [\"a\", \"b\"]}", "True2"},
    {"{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t %}block {{ a }}{% endset %}[{{ t }}]{% set x = "
     "[1,2,3] %}{{ x[0] }}{{ x[-1] }}{{ x[1:] }}{{ x[::-1] }}{{ 'hello'[1:3] }}{{ 'hello'[::-2] "
     "}}{{ x[5] }}",
     "{}", "12[block 1]13[2, 3][3, 2, 1]elolh"},
    {"{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}{% for i in [1] %}{% set x = 3 "
     "%}{{ x }}{% endfor %}{{ x }}",
     "{}", "232"},
};

static const tpl_case macros_cases[] = {
    {"{% macro greet(name, greeting='Hi') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ "
     "greet('Bob') }} {{ greet('Al', greeting='Yo') }} {{ greet(name='Z') }}",
     "{}", "Hi, Bob! Yo, Al! Hi, Z!"},
    {"{% macro m() %}{{ caller_var }}{% endmacro %}{% set caller_var = 'late' %}{{ m() }}{{ m }}",
     "{}", "late<Macro 'm'>"},
};

static const tpl_case whitespace_cases[] = {
    {"  {% if true %}\n  yes\n  {% endif %}\n  {# c #}\nend  {%- if 1 -%}  x  {%- endif -%}  \n{{- "
     "' y ' -}}  \n {%+ if 1 %}plus{% endif %}\n",
     "{}", "  yes\nendx y plus"},
    {"a\n{% if 1 %}\nb\n{% endif %}\nc\n\n", "{}", "a\nb\nc\n"},
    {"{{- 'a' -}}\n\n   {{- 'b' }}  {%- if 1 %} c {% endif -%}  d", "{}", "ab c d"},
};

static const tpl_case filters_cases[] = {
    {"{{ '  x  '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ [1,2]|length }}{{ 'héllo'|length }}{{ "
     "{'a':1}|count }}|{{ u|default('d') }}{{ ''|default('e', true) }}{{ none|default('n') }}|{{ "
     "[1,2,3]|join('-') }}{{ 'abc'|upper }}{{ 'ABC'|lower }}",
     "{}", "x|a|251|deNone|1-2-3ABCabc"},
    {"{{ 'a-b'|replace('-', '+') }}{{ 'aaa'|replace('a','b',2) }}|{{ [3,1,2]|first }}{{ "
     "[3,1,2]|last }}{{ 'abc'|first }}|{{ [1,2,3]|reverse|list }}{{ 'abc'|reverse }}|{{ "
     "[3,1,2]|sort }}{{ ['b','A','c']|sort }}{{ [3,1,2]|sort(reverse=true) }}",
     "{}", "a+bbba|32a|[3, 2, 1]cba|[1, 2, 3]['A', 'b', 'c'][3, 2, 1]"},
    {"{{ ms|selectattr('role','equalto','user')|map(attribute='content')|list }}{{ "
     "ms|rejectattr('role','equalto','user')|list|length }}{{ ms|selectattr('tool')|list|length "
     "}}{{ ms|map(attribute='role')|join(',') }}{{ ms|map(attribute='x', default='D')|list }}",
     "{\"ms\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"bot\", \"content\": \"b\", "
     "\"tool\": 1}, {\"role\": \"user\", \"content\": \"c\"}]}",
     "['a', 'c']11user,bot,user['D', 'D', 'D']"},
    {"{{ d|items|list }}{{ d|dictsort }}{{ d|dictsort(by='value') }}{{ 1|string }}{{ 'ab'|list "
     "}}{{ '42'|int }}{{ 'x'|int }}{{ 3.9|int }}{{ '2.5'|float }}{{ -3|abs }}{{ 2.5|round }}{{ "
     "3.5|round }}{{ 2.567|round(2) }}{{ 2.1|round(method='ceil') }}",
     "{\"d\": {\"b\": 2, \"a\": 1}}",
     "[('b', 2), ('a', 1)][('a', 1), ('b', 2)][('a', 1), ('b', 2)]1['a', "
     "'b']42032.532.04.02.573.0"},
    {"{{ 'line1\nline2\n\nline4'|indent(2) }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent(3, "
     "blank=true) }}|{{ 'hello world-x'|title }}|{{ 'hELLO'|capitalize }}|{{ "
     "['a','A','b','a']|unique|list }}",
     "{}", "line1\n  line2\n\n  line4|  a\n  b|a\n   \n   b|Hello World-X|Hello|['a', 'b']"},
    {"{{ x|tojson }}|{{ x|tojson(indent=2) }}|{{ 'é\"\\\n'|tojson }}|{{ "
     "'é😀'|tojson(ensure_ascii=true) }}|{{ {'b':1,'a':2}|tojson(sort_keys=true) }}|{{ "
     "[1,2]|tojson(separators=(',',':')) }}|{{ []|tojson(indent=2) }}{{ {}|tojson }}",
     "{\"x\": {\"a\": [1, 2.5, null, true, \"s\"], \"b\": {}}}",
     "{\"a\": [1, 2.5, null, true, \"s\"], \"b\": {}}|{\n  \"a\": [\n    1,\n    2.5,\n    null,\n "
     "   true,\n    \"s\"\n  ],\n  \"b\": {}\n}|\"é\\\"\"|\"\\u00e9\\ud83d\\ude00\"|{\"a\": 2, "
     "\"b\": 1}|[1,2]|[]{}"},
    {"{{ range(3)|list }}{{ range(1,4)|list }}{{ range(5,0,-2)|list }}{{ dict(a=1) }}{{ "
     "[1,2,3]|min }}{{ [1,3,2]|max }}{{ ['b','A']|min }}",
     "{}", "[0, 1, 2][1, 2, 3][5, 3, 1]{'a': 1}13A"},
    {"{{ '<a>'|safe + '<b>' }}|{{ '<b>' + '<a>'|safe }}|{{ '<x>'|e }}|{{ '<a>'|safe ~ '<b>' }}",
     "{}", "<a>&lt;b&gt;|&lt;b&gt;<a>|&lt;x&gt;|<a><b>"},
};

static const tpl_case tests_cases[] = {
    {"{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ none is none }}{{ 'a' is string "
     "}}{{ 1 is number }}{{ 1.0 is number }}{{ true is number }}{{ 1 is integer }}{{ true is "
     "integer }}{{ 1.0 is float }}{{ {} is mapping }}{{ [] is iterable }}{{ 'a' is iterable }}{{ "
     "[] is sequence }}{{ true is boolean }}{{ true is true }}{{ 0 is false }}",
     "{\"x\": 1}", "TrueFalseTrueTrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrueFalse"},
    {"{{ 'a' is equalto 'a' }}{{ 1 is eq 2 }}{{ 1 is in [1] }}{{ 3 is odd }}{{ 3 is even }}{{ 9 is "
     "divisibleby 3 }}{{ 9 is divisibleby(4) }}{{ x is not none }}{{ 'A' is upper }}{{ 2 is gt 1 "
     "}}{{ 2 is le 1 }}",
     "{\"x\": null}", "TrueFalseTrueTrueFalseTrueFalseFalseTrueTrueFalse"},
};

static const tpl_case methods_cases[] = {
    {"{{ '  a b  '.strip() }}|{{ 'xa'.lstrip('x') }}|{{ 'ax '.rstrip() }}|{{ 'a,b,,c'.split(',') "
     "}}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a,b,c'.rsplit(',', 1) }}|{{ "
     "'abc'.startswith('ab') }}{{ 'abc'.endswith(('x','c')) }}|{{ 'Ab'.upper() }}{{ 'Ab'.lower() "
     "}}|{{ 'a-b'.replace('-', '') }}|{{ 'hello world'.title() }}|{{ 'hELLO'.capitalize() }}|{{ "
     "'hello'.find('l') }}{{ 'hello'.rfind('l') }}{{ 'hello'.count('l') }}|{{ '-'.join(['a','b']) "
     "}}|{{ 'a\nb'.splitlines() }}",
     "{}",
     "a b|a|ax|['a', 'b', '', 'c']|['a', 'b']|['a', 'b c']|['a,b', 'c']|TrueTrue|ABab|ab|Hello "
     "World|Hello|232|a-b|['a', 'b']"},
    {"{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 5) }}{{ d.keys()|list }}{{ d.values()|list "
     "}}{{ d['a'] }}{{ d.a }}{{ d.zz }}|{{ '{}-{}'.format(1,'x') }}{{ '{0}{0}{n}'.format('a', "
     "n='b') }}{{ '{{}}'.format() }}",
     "{\"d\": {\"a\": 1}}", "1None5['a'][1]11|1-xaab{}"},
};

static const tpl_case blocks_cases[] = {
    {"{% filter upper %}abc {{ x }}{% endfilter %}|{% generation %}gen{% endgeneration %}",
     "{\"x\": \"y\"}", "ABC Y|gen"},
};

static const tpl_case access_cases[] = {
    {"{{ msgs[0]['content'] }}{{ msgs[0].content }}{% if msgs[1] is not defined %}no1{% endif %}{{ "
     "msgs|length }}",
     "{\"msgs\": [{\"content\": \"hi\"}]}", "hihino11"},
};

static const tpl_case chat_idiom_cases[] = {
    /* range and dict views iterate, index (range) and count like lists */
    {"{{ range(3)|length }}{{ range(5)[1:3]|list }}{{ range(3)|last }}{{ d.items()|length }}"
     "{{ d.keys()|first }}{{ (1,)*2 }}{{ d.values()|list }}{{ 2 in range(3) }}",
     "{\"d\": {\"a\": 1, \"b\": 2}}", "3[1, 2]22a(1, 1)[1, 2]True"},
    {"{{ none ~ 'a' }}{{ 'a' * 0 }}|{{ [1,2,][0] }}{{ {'a':1,}['a'] }}|{{ 'abc'[-1] }}{{ 'abc'[5] "
     "}}|{{ x[0] }}",
     "{\"x\": [{\"a\": 1}]}", "Nonea|11|c|{'a': 1}"},
    {"{% for m in messages %}{% if m.content is string %}S{% elif m.content is iterable %}I{% "
     "endif %}{% endfor %}",
     "{\"messages\": [{\"content\": \"a\"}, {\"content\": [{\"t\": 1}]}, {\"content\": null}]}",
     "SI"},
    {"{{ 'a</think>\n\nb'.split('</think>')[-1].lstrip('\n') }}|{{ '\n\n'.join(['a','b']) }}|{{ "
     "'x'|tojson }}|{{ 5|tojson }}",
     "{}", "b|a\n\nb|\"x\"|5"},
    {"{% set c = namespace(x=1) %}{% macro m() %}{% set c.x = c.x + 1 %}{% endmacro %}{{ m() }}{{ "
     "m() }}{{ c.x }}",
     "{}", "3"},
    {"{{ d.items()|list }}{{ d|length }}{{ d.get('a', {}).get('b', 'dflt') }}",
     "{\"d\": {\"a\": {\"b\": 2}}}", "[('a', {'b': 2})]12"},
    {"{% for i in range(3) %}{{ i }}{% if not loop.last %},{% endif %}{% endfor %}|{% for x in "
     "'ab' %}{{ x }}{% endfor %}",
     "{}", "0,1,2|ab"},
    {"{{ x is none or x|length == 0 }}|{{ y is not defined or y }}|{{ (x or 'fallback') }}",
     "{\"x\": null}", "True|True|fallback"},
    {"{{ 1 if true else 2 if false else 3 }}|{{ [1,2,3]|select('odd')|list }}|{{ "
     "[1,2,3]|reject('odd')|list }}|{{ ['a','B']|map('upper')|list }}",
     "{}", "1|[1, 3]|[2]|['A', 'B']"},
    {"{%- for message in messages -%}\n  {%- if message['role'] == 'user' -%}\n    {{ '<user>' + "
     "message['content'] + '</s>' }}\n  {%- endif -%}\n{%- endfor -%}\n{%- if "
     "add_generation_prompt %}\n<bot>\n{%- endif %}",
     "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"add_generation_prompt\": true}",
     "<user>x</s><bot>"},
    {"{% if true %}  \n  a\n{% endif %}  \n{% for x in [1] %}\n\t{{ x }}\n{% endfor %}\n   {#- "
     "comment -#}   \nz",
     "{}", "  \n  a\n  \n\t1\nz"},
    {"{{ 3.0|int }}{{ '3.7'|int }}{{ ' 12 '|int }}{{ true|int }}{{ none|int }}{{ '1e3'|float }}{{ "
     "'abc'|float }}",
     "{}", "3312101000.00.0"},
    {"{{ 10/4 }}{{ 10//4 }}{{ 2**0.5 }}{{ 1e3 }}{{ 1_000 }}{{ 0.5e-3 }}{{ -1|abs }}{{ (-1)|abs }}",
     "{}", "2.521.41421356237309511000.010000.000511"},
    {"{{ [1,2,3] | sum }}", "{}", "6"},
    {"{% set l = [3,1,2] %}{{ l|sort|first }}{{ (l|sort)[-1] }}{{ l|max }}{{ "
     "[{'n':2},{'n':1}]|sort(attribute='n')|map(attribute='n')|list }}{{ "
     "[{'n':2},{'n':1}]|max(attribute='n') }}",
     "{}", "133[1, 2]{'n': 2}"},
    {"{{ loop }}{% for a in [1] %}{{ loop.depth }}{% endfor %}", "{}", "1"},
};

Test(template, idioms_of_real_chat_templates)
{
    CHECK(chat_idiom_cases);
}

Test(template, prints_values_as_python_str_and_repr)
{
    CHECK(printing_cases);
}
Test(template, operators_follow_python)
{
    CHECK(operators_cases);
}
Test(template, for_loops_with_loop_object_else_filter_unpacking_and_loopcontrols)
{
    CHECK(loops_cases);
}
Test(template, scoping_for_is_per_iteration_if_is_not_namespace_carries)
{
    CHECK(scoping_cases);
}
Test(template, macros_with_defaults_keywords_and_late_binding)
{
    CHECK(macros_cases);
}
Test(template, whitespace_control_trim_blocks_lstrip_blocks_and_dashes)
{
    CHECK(whitespace_cases);
}
Test(template, filters)
{
    CHECK(filters_cases);
}
Test(template, tests)
{
    CHECK(tests_cases);
}
Test(template, str_and_dict_methods)
{
    CHECK(methods_cases);
}
Test(template, filter_and_generation_blocks)
{
    CHECK(blocks_cases);
}
Test(template, attribute_and_item_access)
{
    CHECK(access_cases);
}

/* a chat template of the usual shape: system handling, tools as JSON,
 * tool calls, raise_exception on a bad role, generation prompt */
static const char chat_src[] =
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system = messages[0]['content'] %}\n"
    "    {%- set rest = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system = 'You are a helpful assistant.' %}\n"
    "    {%- set rest = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}<|system|>\n"
    "{{ system | trim }}\n"
    "{%- if tools %}\n"
    "\n"
    "# Tools\n"
    "{% for tool in tools %}\n"
    "{{ tool | tojson }}\n"
    "{% endfor %}\n"
    "{%- endif %}\n"
    "<|end|>\n"
    "{% for message in rest %}\n"
    "    {%- if message.role == 'user' %}\n"
    "<|user|>\n"
    "{{ message.content }}<|end|>\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "<|assistant|>\n"
    "{% if message.tool_calls %}\n"
    "{% for call in message.tool_calls %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}\n"
    "{% else %}{{ message.content }}{% endif %}<|end|>\n"
    "    {%- else %}\n"
    "{{ raise_exception('Unknown role: ' + message.role) }}\n"
    "    {%- endif %}\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "<|assistant|>\n"
    "{% endif %}";
static const char chat_ctx[] =
    "{\"bos_token\": \"<s>\", \"add_generation_prompt\": true, \"messages\": [{\"role\": "
    "\"system\", \"content\": \" Be brief. \"}, {\"role\": \"user\", \"content\": \"Weather in "
    "Paris?\"}, {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"function\": "
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"C\"}}}]}, "
    "{\"role\": \"user\", \"content\": \"Thanks ünï\"}], \"tools\": [{\"name\": \"get_weather\", "
    "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}]}";
static const char chat_want[] = "<s><|system|>\n"
                                "Be brief.\n"
                                "# Tools\n"
                                "{\"name\": \"get_weather\", \"parameters\": {\"type\": "
                                "\"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}\n"
                                "<|end|>\n"
                                "<|user|>\n"
                                "Weather in Paris?<|end|><|assistant|>\n"
                                "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                                "\"Paris\", \"unit\": \"C\"}}</tool_call><|end|><|user|>\n"
                                "Thanks ünï<|end|><|assistant|>\n"
                                "";

Test(template, renders_a_chat_template_as_transformers_does)
{
    const tpl_case c[] = {{chat_src, chat_ctx, chat_want}};
    CHECK(c);
    expect_error(chat_src, "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", 0,
                 QL_EINVAL, "Unknown role: robot");
}

Test(template, repr_escapes_what_python_deems_unprintable)
{
    /* jinja2 printed ['a\\xa0b', 'z\\u200bw', '\\ufeff', '\\x85\\x7f\\x01', 'é😀'] */
    const tpl_case c[] = {{"{{ x }}",
                           "{\"x\": [\"a\\u00a0b\", \"z\\u200bw\", \"\\ufeff\", "
                           "\"\\u0085\\u007f\\u0001\", \"é😀\"]}",
                           "['a\\xa0b', 'z\\u200bw', '\\ufeff', '\\x85\\x7f\\x01', 'é😀']"}};
    CHECK(c);
}

Test(template, compiles_once_renders_many_times)
{
    tpl_template *t;
    char msg[256];
    const char *src = "{% for m in messages %}{{ m }}{% endfor %}";
    cr_assert_eq(tpl_compile(&t, src, strlen(src), msg, sizeof msg), QL_OK, "%s", msg);
    for (int i = 0; i < 3; i++) {
        char ctx[64], want[16], *out;
        size_t n;
        snprintf(ctx, sizeof ctx, "{\"messages\": [%d, %d]}", i, i + 1);
        snprintf(want, sizeof want, "%d%d", i, i + 1);
        cJSON *j = cJSON_Parse(ctx);
        cr_assert_eq(tpl_render(t, j, 0, &out, &n, msg, sizeof msg), QL_OK, "%s", msg);
        cr_expect_str_eq(out, want);
        free(out);
        cJSON_Delete(j);
    }
    tpl_free(t);
}

Test(template, maps_json_context_values)
{
    const tpl_case c[] = {
        {"{{ a }}|{{ b }}|{{ c }}|{{ d }}|{{ e }}|{{ f|tojson }}|{{ g is none }}",
         "{\"a\": 1, \"b\": 1.5, \"c\": true, \"d\": \"s\", \"e\": [1, {\"x\": null}], "
         "\"f\": {\"z\": 1, \"a\": [true, false]}, \"g\": null}",
         "1|1.5|True|s|[1, {'x': None}]|{\"z\": 1, \"a\": [true, false]}|True"},
        {"{{ missing }}{{ messages|length }}", NULL, "0"},
    };
    CHECK(c);
}

Test(template, strftime_now_formats_the_current_time)
{
    char *out, msg[256], want[16];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(want, sizeof want, "%Y", &tm);
    cr_assert_eq(render("{{ strftime_now('%Y') }}", "{}", 0, &out, msg, sizeof msg), QL_OK, "%s",
                 msg);
    cr_expect_str_eq(out, want);
    free(out);
}

Test(template, a_trailing_newline_is_dropped_and_crlf_normalised)
{
    const tpl_case c[] = {
        {"a\r\nb\rc\n", "{}", "a\nb\nc"},
        {"a\n\n", "{}", "a\n"},
        {"{% if 1 %}\r\nx{% endif %}", "{}", "x"},
    };
    CHECK(c);
}

Test(template, refuses_unsupported_constructs_by_name_and_line)
{
    expect_error("{% include 'x.jinja' %}", "{}", 0, QL_EUNSUPPORTED,
                 "line 1: statement 'include'");
    expect_error("a\n{% extends 'base' %}", "{}", 0, QL_EUNSUPPORTED,
                 "line 2: statement 'extends'");
    expect_error("{% raw %}x{% endraw %}", "{}", 0, QL_EUNSUPPORTED, "statement 'raw'");
    expect_error("{% call m() %}{% endcall %}", "{}", 0, QL_EUNSUPPORTED, "statement 'call'");
    expect_error("\n\n{{ x|wordwrap(3) }}", "{}", 0, QL_EUNSUPPORTED, "line 3: filter 'wordwrap'");
    expect_error("{{ x|from_json }}", "{}", 0, QL_EUNSUPPORTED, "filter 'from_json'");
    expect_error("{% if x is escaped %}{% endif %}", "{}", 0, QL_EUNSUPPORTED, "test 'escaped'");
    expect_error("{{ x.zfill(3) }}", "{}", 0, QL_EUNSUPPORTED, "method 'zfill'");
    expect_error("{% for x in y recursive %}{% endfor %}", "{}", 0, QL_EUNSUPPORTED, "recursive");
    expect_error("{{ 1 < 2 < 3 }}", "{}", 0, QL_EUNSUPPORTED, "chained comparisons");
    expect_error("{{ f(*args) }}", "{}", 0, QL_EUNSUPPORTED, "*args");
    expect_error("{% set c = cycler('a', 'b') %}", "{}", 0, QL_EUNSUPPORTED, "function 'cycler'");
    expect_error("{% set x | upper %}a{% endset %}", "{}", 0, QL_EUNSUPPORTED, "block set");
}

Test(template, syntax_errors_are_eformat)
{
    expect_error("{% if x %}never closed", "{}", 0, QL_EFORMAT, "expected 'endif'");
    expect_error("{{ x ", "{}", 0, QL_EFORMAT, "unexpected end of template");
    expect_error("{% endfor %}", "{}", 0, QL_EFORMAT, "unexpected 'endfor'");
    expect_error("{{ 'abc }}", "{}", 0, QL_EFORMAT, "unterminated string");
    expect_error("{# no end", "{}", 0, QL_EFORMAT, "unterminated comment");
    expect_error("{{ x y }}", "{}", 0, QL_EFORMAT, "expected '}}'");
    expect_error("{{ @ }}", "{}", 0, QL_EFORMAT, "unexpected character '@'");
    expect_error("{% for x y %}{% endfor %}", "{}", 0, QL_EFORMAT, "expected 'in'");
    expect_error("{% macro m(a=1, b) %}{% endmacro %}", "{}", 0, QL_EFORMAT, "without a default");
}

Test(template, raise_exception_is_einval_with_the_templates_message)
{
    expect_error("{{ raise_exception('Conversation roles must alternate user/assistant') }}", "{}",
                 0, QL_EINVAL, "Conversation roles must alternate user/assistant");
    char *out, msg[256];
    render("{{ raise_exception('exact') }}", "{}", 0, &out, msg, sizeof msg);
    cr_expect_str_eq(msg, "exact", "the message is the template's own, nothing added");
}

Test(template, runtime_errors_name_the_operation_and_line)
{
    expect_error("\n{{ x.y.z }}", "{\"x\": {}}", 0, QL_EINVAL, "line 2: an undefined value");
    expect_error("{{ nope.attr }}", "{}", 0, QL_EINVAL, "'nope' is undefined");
    expect_error("{{ 1 + 'a' }}", "{}", 0, QL_EINVAL,
                 "unsupported operand type(s) for +: 'int' and 'str'");
    expect_error("{{ [1] + 1 }}", "{}", 0, QL_EINVAL, "'list' and 'int'");
    expect_error("{{ 1 // 0 }}", "{}", 0, QL_EINVAL, "division or modulo by zero");
    expect_error("{{ 1 < 'a' }}", "{}", 0, QL_EINVAL, "'<' not supported");
    expect_error("{{ 9223372036854775807 + 1 }}", "{}", 0, QL_EINVAL, "integer overflow");
    expect_error("{{ x.append(1) }}", "{\"x\": []}", 0, QL_EINVAL,
                 "access to attribute 'append' of 'list' object is unsafe");
    expect_error("{{ x|selectattr('a')|length }}", "{\"x\": []}", 0, QL_EINVAL, "generator");
    expect_error("{{ x|map(attribute='a') }}", "{\"x\": [{\"a\": 1}]}", 0, QL_EINVAL, "add |list");
    expect_error("{{ x|tojson }}", "{}", 0, QL_EINVAL, "not JSON serializable");
    expect_error("{{ 5|length }}", "{}", 0, QL_EINVAL, "has no len()");
    expect_error("{% for x in 5 %}{% endfor %}", "{}", 0, QL_EINVAL, "not iterable");
    expect_error("{{ '%s' % 1 }}", "{}", 0, QL_EINVAL, "printf-style");
    expect_error("{{ '{:>3}'.format(1) }}", "{}", 0, QL_EINVAL, "plain fields");
    expect_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "{}", 0, QL_EINVAL,
                 "macro 'm' takes at most 1 arguments");
    expect_error("{{ 'a'|indent(bad=1) }}", "{}", 0, QL_EINVAL,
                 "unexpected keyword argument 'bad'");
    expect_error("{% set a, b = [1] %}", "{}", 0, QL_EINVAL, "cannot unpack");
    expect_error("{% set x = 1 %}{% set x.y = 2 %}", "{}", 0, QL_EINVAL, "non-namespace");
    /* jinja2 prints range(0, 3) and dict_items([...]); serializing them fails in Python */
    expect_error("{{ range(3) }}", "{}", 0, QL_EINVAL, "printing a range is not supported");
    expect_error("{{ d.items() }}", "{\"d\": {}}", 0, QL_EINVAL, "printing a dict_items");
    expect_error("{{ d.keys()|tojson }}", "{\"d\": {}}", 0, QL_EINVAL,
                 "Object of type dict_keys is not JSON serializable");
    /* Python would give a bound method jinja2 prints with its address */
    expect_error("{{ 'x'.center }}", "{}", 0, QL_EINVAL,
                 "'str' attribute 'center' is not supported");
}

Test(template, a_hostile_template_hits_a_bound_not_a_hang, .timeout = 20)
{
    /* 10^10 iterations if unbounded */
    expect_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                 "{}", 0, QL_EINVAL, "loop iterations and calls");
    /* infinite recursion */
    expect_error("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{}", 0, QL_EINVAL,
                 "nested deeper than");
    /* output past max_out */
    expect_error("{% for i in range(1000) %}0123456789{% endfor %}", "{}", 5000, QL_EINVAL,
                 "output grew past 5000 bytes");
    /* memory: a string doubling each iteration */
    expect_error("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s "
                 "%}{% endfor %}",
                 "{}", 0, QL_EINVAL, "bytes of memory");
    expect_error("{{ 'x' * 100000000 }}", "{}", 0, QL_EINVAL, "repetition past the output limit");
    /* values nested without end through a namespace, and one holding itself */
    expect_error("{% set ns = namespace(x=[]) %}{% for i in range(5000) %}{% set ns.x = [ns.x] "
                 "%}{% endfor %}{{ ns.x == ns.x }}",
                 "{}", 0, QL_EINVAL, "values nested deeper than");
    expect_error("{% set ns = namespace() %}{% set ns.me = [ns] %}{{ ns }}", "{}", 0, QL_EINVAL,
                 "nested deeper than");
    /* deep expressions inside recursive macros: one bound on the C stack */
    expect_error("{% macro f(n) %}{{ (((((f(n + 1)))))) }}{% endmacro %}{{ f(0) }}", "{}", 0,
                 QL_EINVAL, "nested deeper than");
}

Test(template, deep_nesting_is_refused_at_compile)
{
    char src[2048];
    size_t n = 0;
    n += (size_t)snprintf(src + n, sizeof src - n, "{{ ");
    for (int i = 0; i < 500; i++)
        src[n++] = '(';
    src[n++] = '1';
    for (int i = 0; i < 500; i++)
        src[n++] = ')';
    snprintf(src + n, sizeof src - n, " }}");
    expect_error(src, "{}", 0, QL_EUNSUPPORTED, "nesting deeper than");
}

Test(template, bad_arguments_are_refused)
{
    char msg[128], *out;
    size_t n;
    tpl_template *t;
    cr_expect_eq(tpl_compile(&t, "{{ x }}", 7, msg, sizeof msg), QL_OK);
    cJSON *arr = cJSON_Parse("[1]");
    cr_expect_eq(tpl_render(t, arr, 0, &out, &n, msg, sizeof msg), QL_EINVAL);
    cr_expect(strstr(msg, "JSON object") != NULL, "%s", msg);
    cJSON_Delete(arr);
    tpl_free(t);
    cr_expect_eq(tpl_render(NULL, NULL, 0, &out, &n, msg, sizeof msg), QL_EINVAL);
    tpl_free(NULL);
    cr_expect_eq(tpl_compile(&t, "a\0{{ x }}", 9, msg, sizeof msg), QL_EFORMAT, "a NUL byte");
    cr_expect_null(t);
    cr_expect_eq(tpl_compile(&t, "", 0, msg, sizeof msg), QL_OK, "an empty template is valid");
    cr_expect_eq(tpl_render(t, NULL, 0, &out, &n, msg, sizeof msg), QL_OK);
    cr_expect_eq(n, 0);
    free(out);
    tpl_free(t);
}
